"""A replica's decode sessions (engine/execution/session.py), framework-free: open, chunk, close,
expire, and the room they hold.

- Room: every open session's causal cache was priced at open (`held_price`) and is held in the
  replica's session budget (`limits.max_session_bytes`, default half the decode bound) until it is
  closed, disconnected or expired. A session that would not fit beside those open is refused at open
  (429 + Retry-After when others hold the room, 413 when it can never fit): never an out-of-memory
  in the middle of a video. `limits.max_sessions` bounds their count.
- Chunks are requests: each is checked (DecodeEngine.check_chunk) and queued in the replica's
  scheduler in the session's class (`realtime` unless it claimed another at open) under its own
  deadline, so sessions' chunks of one key decode together, and a chunk runs its steps before less
  urgent work's next step (serving/scheduling/scheduler.py). One chunk of a session at a time, in
  order (`latent_frame`).
- Expiry: a session idle past `sessions.idle_timeout_s` is freed by a sweep; its id is remembered
  (bounded) so its next chunk gets `session_expired` naming the frames it had decoded. An id this
  replica never issued (its owner is gone) gets `session_lost`.
- mp4/webm: one file across all chunks, a fragment (a WebM Cluster) per latent frame, encoded in the
  encoder pool; the first fragment begins with the init segment.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from vae_service.engine.execution.session import ChunkFrames, DecodeSession
from vae_service.engine.execution.session_state import SessionState, VideoState
from vae_service.engine.media.encoding import video_writer
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.decode_request import VIDEO_OUTPUTS, DecodeRequest
from vae_service.engine.request.errors import DecodeTimeout, InvalidInput, LimitExceeded, Overloaded
from vae_service.engine.request.session import SessionExpired, SessionLost, SessionMoved, SessionOpen
from vae_service.protocol.sessions import Delivery
from vae_service.serving.outputs.encoders import EncoderPool, failed_encode
from vae_service.serving.outputs.video_stream import MEDIA_TYPES
from vae_service.serving.scheduling.classes import session_class
from vae_service.serving.viewers.feed import Fragment
from vae_service.serving.viewers.hub import ViewerHub
from vae_service_client.mp4 import Mp4Fragment

log = logging.getLogger("ray.serve")
EXPIRED_KEPT = 4096  # expired or closed session ids remembered, to answer their chunks `session_expired`
SWEEP_EVERY_S = 1.0


@dataclass(frozen=True)
class ChunkAnswer:
    """A chunk's frames (or, for mp4/webm, its fragments) and the session after it."""

    frames: ChunkFrames
    fragments: tuple[Mp4Fragment, ...]
    encode_ms: float
    queue_ms: float

    def done(self, session: DecodeSession, checkpointed: int = 0) -> dict:
        """`checkpointed`: the latent frames the session's latest checkpoint holds (a client keeps
        only the latents after it to resume from)."""
        f = self.frames
        return {
            "latent_frame": f.latent_frame,
            "latent_frames": session.latent_frames,
            "frames": session.frames,
            "checkpointed_latent_frames": checkpointed,
            "precision": f.precision,
            **({"fallback_from_frame": f.fallback_from_frame} if f.fallback_from_frame is not None else {}),
            "timing": {
                "queue_ms": round(self.queue_ms, 3),
                "decode_ms": round(f.decode_ms, 3),
                "encode_ms": round(self.encode_ms, 3),
                "batch_size": f.batch_size,
                "preempted_ms": round(f.preempted_ms, 3),
            },
        }


class _Video:
    """A session's one mp4/webm file, continued chunk by chunk (a fragment per latent frame). Only a
    chunk whose fragments were all encoded counts (`advance`): a writer whose encode failed or was
    stopped is dropped (its thread may still be at work on it) and the next chunk's writer goes on
    from the last fragment the session answered, with the same init segment."""

    def __init__(self, output: str, pool: EncoderPool, state: VideoState | None = None):
        self.output, self.pool, self.writer = output, pool, None
        self.init: bytes | None = None  # the file's init segment, sent with its first answered fragment
        self.frames = self.fragments_sent = 0  # what the fragments answered so far hold
        if state is not None:  # a file begun on another replica: its next writer goes on from there
            self.init, self.frames, self.fragments_sent = state.init, state.frames, state.fragments_sent

    def state(self) -> VideoState:
        return VideoState(self.init, self.frames, self.fragments_sent)

    async def fragments(self, frames: ChunkFrames, counts: list[int], context: RequestContext) -> list[Mp4Fragment]:
        pixels = frames.pixels[0].numpy()
        try:
            writer = self.writer or await self._writer(pixels, context)
            out, start, frame = [], 0, frames.frame
            for n in counts:
                data = await self._run(writer.fragment, context, np.ascontiguousarray(pixels[start : start + n]))
                out.append(Mp4Fragment(frame, n, data))
                start, frame = start + n, frame + n
        except BaseException:
            self.close()
            raise
        if self.fragments_sent == 0:
            out[0] = Mp4Fragment(out[0].frame, out[0].frames, self.init + out[0].data)
        return out

    def advance(self, fragments: list[Mp4Fragment]) -> None:
        self.frames += sum(f.frames for f in fragments)
        self.fragments_sent += len(fragments)

    async def _writer(self, pixels: np.ndarray, context: RequestContext):
        height, width = pixels.shape[1:3]
        writer = await self._run(video_writer, context, self.output, int(width), int(height), self.pool.settings)
        if self.init is None:
            self.init = writer.init_segment()
        elif writer.init_segment() != self.init:  # the file's decoders were told another stream's settings
            raise failed_encode(self.output, RuntimeError("a new encoder's init segment differs from the file's"))
        writer.resume(self.frames, self.fragments_sent)
        self.writer = writer
        return writer

    async def _run(self, work, context: RequestContext, *args):
        future = asyncio.get_running_loop().run_in_executor(self.pool.executor, work, *args)
        try:
            return await asyncio.wait_for(future, context.remaining())
        except TimeoutError:
            raise DecodeTimeout("output", "not encoded within request_timeout_s") from None
        except Exception as exc:
            raise failed_encode(self.output, exc) from None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class SessionRegistry:
    """`service`: the replica's DecodeService (its engine, live limits, scheduler submit, encoders)."""

    def __init__(self, service, owner: Callable[[], str], clock: Callable[[], float] = time.monotonic):
        self.service, self.owner, self.clock = service, owner, clock
        self.open_sessions: dict[str, DecodeSession] = {}
        self._videos: dict[str, _Video] = {}
        self._gone: collections.OrderedDict[str, tuple[int, int, str]] = collections.OrderedDict()
        # sessions that left in a drain: True where their state went to the keeper (handed on)
        self._departed: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self.moving: set[str] = set()  # leaving: its chunks are answered SessionMoved
        self._departures: dict[str, asyncio.Future] = {}  # set (kept or not) once it has left
        self.checkpointed: dict[str, int] = {}  # latent frames of each session's latest checkpoint
        self.bound: dict[str, object] = {}  # the conversation a session is driven by (an attach rebinds it)
        self.on_applied: Callable[[DecodeSession], None] = lambda session: None  # a chunk became part of it
        self.on_closed: Callable[[str], None] = lambda session_id: None  # its client closed it: nothing to keep
        self.adopted = 0
        self._sweeper: asyncio.Task | None = None
        self.opened = self.expired = self.chunks = 0
        self.connections = 0  # conversations (WebSocket, DecodeSession) on this replica, open or not yet
        self.on_change: Callable[[], None] = lambda: None  # connections or open sessions changed (metrics)
        self.chunk_ms: collections.deque[float] = collections.deque(maxlen=256)
        self.delivery: dict[str, Delivery] = {}  # sessions whose frames do not go (only) back to their caller
        self.viewers = ViewerHub(
            lambda: service.config.watch, lambda: service.config.serving.retry_after_s, lambda token: False
        )

    @property
    def engine(self):
        return self.service.engine

    @property
    def idle_timeout_s(self) -> float:
        return self.service.config.sessions.idle_timeout_s

    def budget(self) -> int:
        limits = self.service.config.limits
        return limits.max_session_bytes or self.engine.cost.bound(limits) // 2

    @property
    def held_bytes(self) -> int:
        return sum(s.held_price for s in self.open_sessions.values())

    # ---- connections -----------------------------------------------------------------------
    def connect(self) -> None:
        """A conversation begins: it takes one of the replica's session connections
        (ServiceConfig.session_connections; Overloaded when all are taken), whether it opens a session
        or not; `disconnect` gives it back."""
        config = self.service.config
        room = config.session_connections
        if room == 0:
            raise LimitExceeded(
                "session",
                f"this deployment takes no session connections (sessions.max_connections "
                f"{config.sessions.max_connections}, within {config.decode_slots} decode slots less a full batch)",
            )
        if self.connections >= room:
            raise Overloaded(
                "session",
                f"{self.connections} session connections are open on this replica (sessions.max_connections, within "
                f"its decode slots less a full batch: {room}); retry when one closes",
                config.serving.retry_after_s,
            )
        self.connections += 1
        self._changed()

    def disconnect(self) -> None:
        self.connections -= 1
        self._changed()

    def _changed(self) -> None:
        """Tell on_change (metrics); its failure never costs a session or a connection its count."""
        try:
            self.on_change()
        except Exception:
            log.exception("reporting the sessions' metrics failed")

    # ---- open ------------------------------------------------------------------------------
    def open(self, settings: SessionOpen, delivery: Delivery = Delivery()) -> DecodeSession:
        """A new session on this replica, or the error naming why not (nothing is held then)."""
        self.sweep()
        limits = self.service.config.limits
        if limits.max_sessions == 0:
            raise LimitExceeded("session", "this deployment opens no decode sessions (limits.max_sessions is 0)")
        priority = session_class(settings.priority, self.service.config.scheduling)  # its chunks' class
        session_id = f"{self.owner()}.{uuid.uuid4().hex}"  # the owner: the session router's affinity key
        session = self.engine.open_session(session_id, replace(settings, priority=priority), limits)
        self._take(session)
        self._deliver(session.id, delivery)
        self.opened += 1
        return session

    def _deliver(self, session_id: str, delivery: Delivery, kept: dict | None = None) -> None:
        """`kept`: what the session brought from another replica (its watch id and token)."""
        kept = kept or {}
        if delivery != Delivery():
            self.delivery[session_id] = delivery
        if delivery.watch:
            self.viewers.watch(session_id, kept.get("watch_token"), kept.get("watch_id"))

    def frames_back(self, session_id: str) -> bool:
        """Whether the session's caller gets its frames (else only each chunk's chunk_done)."""
        return self.delivery.get(session_id, Delivery()).frames_back

    def adopt(self, state: SessionState) -> DecodeSession:
        """A session another replica handed off or checkpointed, continued here: priced in this
        replica's session budget as an open (Overloaded where the room is taken: the client retries,
        and may reach another replica), its video file going on where it was."""
        self.sweep()
        self._gone.pop(state.id, None)
        self._departed.pop(state.id, None)
        session = self.engine.adopt_session(state, self.service.config.limits)
        self._take(session, state.video)
        kept = dict(state.delivery)
        self._deliver(session.id, Delivery(kept.get("frames_back", True), "watch_token" in kept), kept)
        self.checkpointed[session.id] = state.latent_frames
        self.adopted += 1
        return session

    def _take(self, session: DecodeSession, video: VideoState | None = None) -> None:
        limits, retry_after = self.service.config.limits, self.service.config.serving.retry_after_s
        settings, budget, held = session.settings, self.budget(), self.held_bytes
        if session.held_price > budget:
            raise LimitExceeded(
                "height",
                f"a session at {settings.height}x{settings.width} holds about {session.held_price} bytes of causal "
                f"cache, over the sessions' budget of {budget} (limits.max_session_bytes): open a smaller one",
            )
        if len(self.open_sessions) >= limits.max_sessions or held + session.held_price > budget:
            raise Overloaded(
                "session",
                f"{len(self.open_sessions)} sessions hold {held} of {budget} bytes (limits.max_session_bytes, "
                f"max_sessions {limits.max_sessions}); retry when one closes",
                retry_after,
            )
        self.open_sessions[session.id] = session
        if settings.output in VIDEO_OUTPUTS:
            self._videos[session.id] = _Video(settings.output, self.service.encoders, video)
        self._ensure_sweeper()
        self._changed()

    async def export(self, session_id: str) -> SessionState:
        """The open session as plain data on the host, as it stands now: its walk, counts and video
        file taken together here, on the loop (a chunk applied meanwhile is not half in it), its
        history copied to the host off the loop (the history's tensors are never written)."""
        session = self.open_sessions[session_id]
        frozen = replace(session, walk=session.walk.fork())
        video = self._videos.get(session_id)
        video_state = None if video is None else video.state()
        delivery = self.delivery.get(session_id, Delivery())
        kept = {"frames_back": delivery.frames_back}
        feed = self.viewers.feed_of(session_id)
        if feed is not None:
            kept["watch_token"], kept["watch_id"] = feed.token, feed.watch_id
        state = await asyncio.to_thread(self.engine.export_session, frozen)
        return state.with_video(video_state, kept)

    def describe_session(self, session: DecodeSession) -> dict:
        engine = self.engine
        return {
            "session": session.id,
            "model": engine.spec.name,
            "quality": session.quality,
            "precision": session.precision,
            "output": session.settings.output,
            "priority": session.settings.priority,
            "held_bytes": session.held_price,
            "idle_timeout_s": self.idle_timeout_s,
            "max_chunk_latent_frames": self.service.config.limits.max_session_chunk_frames,
            "latent_channels": engine.spec.latent_channels,
            "spatial_scale": engine.spec.spatial_scale,
            "request_id": session.settings.request_id,
            **self._watch_summary(session.id),
        }

    def _watch_summary(self, session_id: str) -> dict:
        """A watched session's `watch`: its viewers' token and the watch page's path (relative to
        the service's base URL; the token in the fragment, which a browser never sends)."""
        feed = self.viewers.feed_of(session_id)
        if feed is None:
            return {}
        watch_id, token = feed.watch_id, feed.token
        return {"watch": {"id": watch_id, "token": token, "url": f"/watch/{watch_id}#token={token}"}}

    # ---- chunks ----------------------------------------------------------------------------
    def session(self, session_id: str) -> DecodeSession:
        """The open session of that id; SessionExpired where it was closed or expired here,
        SessionLost where this replica never had it (the replica that did is gone)."""
        self.sweep()
        session = self.open_sessions.get(session_id)
        if session is not None:
            if session_id in self.moving:
                raise SessionMoved("session", "it is moving to another replica (this one drains): attach to it there")
            return session
        if self._departed.get(session_id):
            raise SessionMoved("session", "it moved to another replica (this one drains): attach to it there")
        gone = self._gone.get(session_id)
        if gone is not None:
            frames, latent_frames, why = gone
            raise SessionExpired(
                "session",
                f"{why}: it had decoded {frames} frames ({latent_frames} latent frames); open a new session "
                "and send its latents again",
                frames,
                latent_frames,
            )
        raise SessionLost(
            "session", f"no session {session_id!r} here: the replica that held it is gone; resume in a new session"
        )

    async def chunk(self, session_id: str, request: DecodeRequest, latent_frame: int | None = None) -> ChunkAnswer:
        """Decode the session's next chunk: checked (InvalidInput naming the field: the session is
        untouched), queued in its class (the session's) under its own deadline, encoded where the output is a video;
        the session takes the chunk only once its answer is ready (any failure before: untouched)."""
        session = self.session(session_id)
        if session.busy:
            raise InvalidInput("session", "this session's previous chunk is still decoding: send one at a time")
        if latent_frame is not None and latent_frame != session.latent_frames:
            raise InvalidInput(
                "latent_frame",
                f"out of order: the session has decoded {session.latent_frames} latent frames, this chunk says it "
                f"starts at {latent_frame}",
            )
        session.busy, arrived, arrived_ms = True, time.perf_counter(), time.time() * 1e3
        try:
            context = self.service.admit()
            chunk = await asyncio.to_thread(self.engine.check_chunk, session, request, context)
            frames = await self.service.submit_prepared(chunk, context, session.settings.priority)
            queue_ms = max(0.0, (time.perf_counter() - arrived) * 1e3 - frames.decode_ms - frames.preempted_ms)
            fragments, encode_ms = [], 0.0
            video = self._videos.get(session_id)
            if video is not None:
                start = time.perf_counter()
                counts = self._fragment_frames(frames.latent_frame, chunk.prepared.latent_frames)
                first = video.fragments_sent == 0
                fragments = await video.fragments(frames, counts, context)
                encode_ms = (time.perf_counter() - start) * 1e3
                video.advance(fragments)
                self._publish(session_id, video, frames, counts, fragments, first, arrived_ms)
            session.advance(frames.step)
            self.chunks += 1
            self.on_applied(session)
            self.chunk_ms.append((time.perf_counter() - arrived) * 1e3)
            return ChunkAnswer(frames, tuple(fragments), encode_ms, queue_ms)
        finally:
            session.busy, session.last_used = False, self.clock()

    def _publish(self, session_id, video, frames, counts, fragments, first: bool, arrived_ms: float) -> None:
        """A watched session's chunk to its viewers (never waits for them: serving/viewers/feed.py)."""
        if self.viewers.feed_of(session_id) is None:
            return
        pixels, start, out = frames.pixels[0].numpy(), 0, []
        for i, (fragment, n) in enumerate(zip(fragments, counts, strict=True)):
            data = fragment.data[len(video.init) :] if first and i == 0 else fragment.data
            out.append(Fragment(fragment.frame, n, data, pixels[start : start + n], arrived_ms))
            start += n
        content_type = f'{MEDIA_TYPES[video.output]}; codecs="{video.writer.codecs}"'
        self.viewers.publish(session_id, out, video.init, content_type)

    def _fragment_frames(self, first_latent: int, latent_frames: int) -> list[int]:
        """Frames per fragment of a chunk: one latent frame's each (the first latent frame of a clip
        gives the law's offset fewer), as a whole answer's fragments (engine/media/encoding.py)."""
        a, b = self.engine.spec.geometry.frames.law
        return [a + (b if first_latent + i == 0 else 0) for i in range(latent_frames)]

    # ---- close and expiry ------------------------------------------------------------------
    def close(
        self, session_id: str, why: str = "the session was closed", by_client: bool = False, ended: str = "lost"
    ) -> dict | None:
        """Free the session at once (closed, disconnected, expired); its summary, None if it was not
        open. `by_client`: its client closed it (nothing of it is kept anywhere: a disconnect or an
        expiry leaves its latest checkpoint to resume from). `ended`: what its viewers are told."""
        session = self._free(session_id, "closed" if by_client else ended)
        if session is None:
            return None
        self._gone[session_id] = (session.frames, session.latent_frames, why)
        _bounded(self._gone)
        self._departures.pop(session_id, None)  # a session closed is not one that moved: its conversation goes on
        if by_client:
            self.on_closed(session_id)
        return {"frames": session.frames, "latent_frames": session.latent_frames}

    def _free(self, session_id: str, ended: str) -> DecodeSession | None:
        session = self.open_sessions.pop(session_id, None)
        if session is None:
            return None
        self.viewers.end(session_id, ended)
        self.delivery.pop(session_id, None)
        session.closed = True
        video = self._videos.pop(session_id, None)
        if video is not None:
            video.close()
        self.checkpointed.pop(session_id, None)
        self.bound.pop(session_id, None)
        self.moving.discard(session_id)
        self._changed()
        return session

    def bind(self, session_id: str, conversation: object) -> None:
        """`conversation` drives the session from now (an attach takes it from a connection that has
        not noticed it dropped: the old one's end then leaves the session alone)."""
        self.bound[session_id] = conversation

    def release(self, session_id: str, conversation: object, why: str) -> None:
        """A conversation ended: its session is freed unless another conversation drives it now."""
        if self.bound.get(session_id, conversation) is conversation:
            self.close(session_id, why, ended="disconnected")

    def begin_move(self, session_id: str) -> None:
        """The session stops taking chunks here (each is answered SessionMoved) until it has left."""
        self.moving.add(session_id)

    def departure(self, session_id: str) -> asyncio.Future:
        """Done once the session has left this replica in a drain: True where its state is kept for
        another replica, False where it could not be (closed here); for its conversation to say so,
        however late it asks. Never done for a session closed or expired otherwise."""
        loop = asyncio.get_running_loop()
        if session_id in self._departed:
            done = loop.create_future()
            done.set_result(self._departed[session_id])
            return done
        if session_id not in self.open_sessions:  # closed or expired here: its conversation says so itself
            return loop.create_future()
        if session_id not in self._departures:
            self._departures[session_id] = loop.create_future()
        return self._departures[session_id]

    def left(self, session_id: str, kept: bool) -> None:
        """The session's state is kept elsewhere (`kept`: its client attaches to it on another
        replica) or could not be (it is closed here: the client resumes by replaying)."""
        departure = self._departures.pop(session_id, None)
        if kept:
            self._free(session_id, "moved")
        else:
            self.close(session_id, "its replica shut down and its state could not be handed to another")
        self._departed[session_id] = kept
        _bounded(self._departed)
        if departure is not None and not departure.done():
            departure.set_result(kept)

    def sweep(self) -> None:
        """Free every session idle past the timeout (not one whose chunk is running)."""
        now, timeout = self.clock(), self.idle_timeout_s
        idle = [s.id for s in self.open_sessions.values() if not s.busy and now - s.last_used > timeout]
        for session_id in idle:
            self.close(
                session_id,
                f"the session expired after {timeout:g} s without a chunk (sessions.idle_timeout_s)",
                ended="expired",
            )
            self.expired += 1

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while self.open_sessions:
            await asyncio.sleep(min(SWEEP_EVERY_S, self.idle_timeout_s / 2))
            self.sweep()

    def close_all(self) -> None:
        for session_id in list(self.open_sessions):
            self.close(session_id, "the replica shut down")
        if self._sweeper is not None:
            self._sweeper.cancel()

    def describe(self) -> dict:
        ms = sorted(self.chunk_ms)
        return {
            "open": len(self.open_sessions),
            "connections": self.connections,
            "max_connections": self.service.config.session_connections,
            "held_bytes": self.held_bytes,
            "budget_bytes": self.budget(),
            "opened": self.opened,
            "expired": self.expired,
            "chunks": self.chunks,
            "adopted": self.adopted,
            "chunk_ms_p50": round(ms[len(ms) // 2], 3) if ms else None,
            "unsupported_because": self.engine.sessions_unsupported_because(),
        }


def _bounded(remembered: collections.OrderedDict) -> None:
    while len(remembered) > EXPIRED_KEPT:
        remembered.popitem(last=False)
