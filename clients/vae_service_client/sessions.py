"""Decode sessions: a video decoded chunk by chunk as a denoiser produces its latents, over the
service's WebSocket `/sessions` (one session per connection, on the replica that accepted it).

Every message either way is one binary WebSocket message holding one msgpack map. The client sends
`{"open": {...}}`, then `{"chunk": {"latents", "latent_frame"}}` one at a time (each answered up to
its `chunk_done` or `error` before the next goes), then `{"close": {}}`; the server answers
`opened`, each chunk's frame messages (`{"item", "frame", "pixels"}`, as a frame stream's) or
mp4/webm fragments (`{"frame", "frames", "fragment"}`: all of a session's, joined, are one playable
file), `chunk_done`, and `closed`. A chunk's `error` leaves the session open and unchanged (the
chunk was not applied); `session_expired` and an open's error end the connection. A session opened
with `frames: "none"` is answered each chunk's `chunk_done` alone; one opened with `watch: true`
(mp4/webm) says in `opened` (and `attached`) how viewers watch it.

SessionBook holds what the sync and async clients share: the messages, the counts, the frames a
resume must not hand out twice, and the chunks it replays. DecodeSession and AsyncDecodeSession
only move its bytes over a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit, urlunsplit

import msgpack
import numpy as np
from websockets.asyncio.client import connect as connect_async
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import connect

from vae_service_client.errors import (
    ERROR_KINDS,
    DecodeTimeout,
    Overloaded,
    ServiceUnreachable,
    SessionExpired,
    SessionLost,
    SessionMoved,
    Unavailable,
    VaeServiceError,
    connection_error,
    did_you_mean,
    error_from_http,
    make_error,
    refused_here,
)
from vae_service_client.frames import MAX_MESSAGE_BYTES
from vae_service_client.messages import UNSET, latents_map, pack
from vae_service_client.mp4 import _open as open_target
from vae_service_client.retries import with_retries, with_retries_async
from vae_service_client.tensors import LATENT_DTYPES, decode_tensor

SESSION_OUTPUTS = ("uint8", "float", "mp4", "webm")
VIDEO_OUTPUTS = ("mp4", "webm")  # one fragmented file across the session's chunks
SESSION_OPTIONS = ("scaling_factor", "shift_factor", "model", "request_id", "clip_latent_frames", "priority")
FRAMES = ("all", "none")  # what each chunk answers besides its chunk_done: its frames (fragments), or nothing
CLOSE = pack({"close": {}})
SESSION_HEADER = "x-session-id"  # Serve's proxy routes a call carrying it to the session's replica
MESSAGE_TOO_BIG = 1009  # the WebSocket close code of a message over the receiver's limit (RFC 6455)


# ---- messages -----------------------------------------------------------------------------------
def ws_url(base_url: str) -> str:
    """The `/sessions` WebSocket beside a client's HTTP base URL (its path kept: a route prefix)."""
    parts = urlsplit(str(base_url))
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/sessions", "", ""))


def open_fields(
    height: int,
    width: int,
    quality: str = "lossless",
    output: str = "uint8",
    dtype: str = "float32",
    frames: str = "all",
    watch: bool = False,
    **options,
) -> dict:
    """The `open` message's map. `height`/`width` are the latents' (every chunk's); `dtype` the chunks'
    (the server refuses another). `frames`: "all" (each chunk's frames or fragments) or "none" (each
    chunk answers only its chunk_done: a denoiser whose output only viewers watch); `watch`: viewers
    may watch the session (output mp4 or webm: they stream its file). Both are left off the map at
    their defaults, so a server that predates them opens the session as before. `options`:
    scaling_factor, shift_factor (UNSET: the model's own, None: the latents are already scaled, as
    /decode takes them), model, request_id, clip_latent_frames (the clip's length where known: exact
    bits for long clips on CPU), priority (the scheduler's class for the chunks,
    messages.PRIORITIES; None: the server's default, `realtime`). What the client itself depends on
    (sizes, output, dtype, frames, watch, option names) is refused here, before any I/O."""
    for name in options:
        if name not in SESSION_OPTIONS:
            raise refused_here(
                name, f"unknown argument{did_you_mean(name, SESSION_OPTIONS)} (allowed: {SESSION_OPTIONS})"
            )
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise refused_here(name, f"the latents' {name}: a positive integer, got {value!r}")
    if output not in SESSION_OUTPUTS:
        raise refused_here(
            "output",
            f"a session answers {list(SESSION_OUTPUTS)}, not {output!r}{did_you_mean(output, SESSION_OUTPUTS)}",
        )
    if dtype not in LATENT_DTYPES:
        raise refused_here("dtype", f"the chunks' dtype: one of {list(LATENT_DTYPES)}, not {dtype!r}")
    if not isinstance(frames, str) or frames not in FRAMES:
        hint = did_you_mean(frames, FRAMES) if isinstance(frames, str) else ""
        raise refused_here(
            "frames",
            f"what each chunk answers: 'all' (its frames) or 'none' (its chunk_done alone), not {frames!r}{hint}",
        )
    if not isinstance(watch, bool):
        raise refused_here("watch", f"True or False, got {watch!r}")
    if watch and output not in VIDEO_OUTPUTS:
        raise refused_here("watch", f"viewers stream the session's own file: output mp4 or webm, not {output!r}")
    fields = {"height": int(height), "width": int(width), "quality": quality, "output": output, "dtype": dtype}
    if frames != "all":
        fields["frames"] = frames
    if watch:
        fields["watch"] = True
    for key in ("scaling_factor", "shift_factor"):
        if options.get(key, UNSET) is not UNSET:
            fields[key] = options[key]
    for key in ("model", "request_id", "clip_latent_frames", "priority"):
        if options.get(key) is not None:
            fields[key] = options[key]
    return fields


def chunk_fields(latents, latent_frame: int, settings: dict) -> dict:
    """The `chunk` message's map: latents [1, C, t, H, W] of the session's H, W and dtype (else refused
    here, nothing sent), starting at latent frame `latent_frame` of the session."""
    shape = tuple(getattr(latents, "shape", ()))
    if len(shape) != 5 or shape[0] != 1:
        raise refused_here("latents.shape", f"a chunk is [1, C, t, H, W] (one video item), got {list(shape)}")
    if 0 in shape:
        raise refused_here(
            "latents",
            f"an empty chunk, shape {list(shape)}: a chunk is [1, C, t, H, W] with t >= 1 latent frames "
            "(and no empty axis)",
        )
    if shape[3:] != (settings["height"], settings["width"]):
        size = f"{settings['height']}x{settings['width']}"
        raise refused_here("latents.shape", f"the session was opened for {size} latents, got {shape[3]}x{shape[4]}")
    tensor = latents_map(latents)
    if tensor["dtype"] != settings["dtype"]:
        raise refused_here(
            "latents.dtype", f"the session was opened for {settings['dtype']} chunks, got {tensor['dtype']}"
        )
    return {"latents": tensor, "latent_frame": latent_frame}


def chunks_of(latents, latent_frames: int) -> Iterator:
    """A whole video latent [1, C, T, H, W] as consecutive chunks of `latent_frames` latent frames
    (the last may be shorter): views, nothing copied."""
    if isinstance(latent_frames, bool) or not isinstance(latent_frames, int) or latent_frames < 1:
        raise refused_here("chunks", f"latent frames per chunk: a positive integer, got {latent_frames!r}")
    shape = tuple(getattr(latents, "shape", ()))
    if len(shape) != 5 or shape[0] != 1:
        raise refused_here("latents.shape", f"a session decodes one video latent [1, C, T, H, W], got {list(shape)}")
    for start in range(0, shape[2], latent_frames):
        yield latents[:, :, start : start + latent_frames]


def unpack(raw) -> tuple[str, dict]:
    """One server message (msgpack bytes, or the map a gRPC reply reads as): (its kind, its map)."""
    if isinstance(raw, dict):
        message = raw
    elif isinstance(raw, bytes | bytearray | memoryview):
        message = msgpack.unpackb(raw, raw=False)
    else:
        raise make_error("internal", None, "the server sent a text message; sessions speak binary msgpack")
    if isinstance(message, dict) and "fragment" in message:
        return "fragment", message
    if isinstance(message, dict) and "pixels" in message:
        return "pixels", message
    if not isinstance(message, dict) or len(message) != 1:
        raise make_error("internal", None, f"not a session message: {str(message)[:200]}")
    ((kind, fields),) = message.items()
    return kind, fields


def answer_error(fields: dict) -> VaeServiceError:
    """An `error` message as its typed exception (SessionExpired, InvalidRequest, Overloaded, ...)."""
    type_ = fields.get("type")
    type_ = type_ if type_ in ERROR_KINDS else "internal"  # a newer server's type: an error all the same
    return make_error(type_, fields.get("field"), fields.get("message", ""), fields.get("retry_after"))


def trim_pixels(frame: int, pixels: np.ndarray, seen: int) -> tuple[int, np.ndarray] | None:
    """Frames `frame`.. of a frame message, less those before `seen` (handed out already, and decoded
    again by a resume's replay); None when none is left. uint8 [1, t, H, W, 3] / float [1, 3, t, H, W]."""
    axis = 1 if pixels.dtype == np.uint8 else 2
    drop = max(0, seen - frame)
    if drop >= pixels.shape[axis]:
        return None
    kept = (slice(None),) * axis + (slice(drop, None),)
    return frame + drop, pixels[kept]


def new_fragments(fragments: list[dict], seen: int) -> list[dict]:
    """The fragments whose frames were not handed out yet. A replay's fragments are byte-identical to
    the first session's (the encoders are deterministic), so they are dropped whole; the first one
    carries the init segment, which a file begun already holds."""
    return [f for f in fragments if f["frame"] >= seen]


@dataclass(frozen=True)
class SessionChunk:
    """One chunk's answer: frames `frame`.. (`frames` of them) of latent frames `latent_frame`..
    (`latent_frames`), as `pixels` (uint8 [1, t, H, W, 3] or float [1, 3, t, H, W]; None for mp4/webm)
    or `fragment` (the bytes to append to the session's file; the first chunk's begins with the init
    segment; None for frames). `precision` and `timing` (queue_ms, decode_ms, encode_ms, batch_size)
    are the server's; `fallback_from_frame`: the session's first fp32 frame where a chunk overflowed
    fp16/bf16 (the session goes on in fp32), else None. A session opened with frames="none" hands
    out none: `pixels` None and `fragment` b"" (mp4/webm), the counts and timing as ever."""

    latent_frame: int
    latent_frames: int
    frame: int
    frames: int
    pixels: np.ndarray | None
    fragment: bytes | None
    precision: str
    timing: dict
    fallback_from_frame: int | None = None


@dataclass(frozen=True)
class Watch:
    """How viewers watch a session opened with watch=True: `url` opens its watch page (the token in
    its fragment, which a browser does not send to the server); `token` authorizes the page's WHEP
    and stream endpoints (`/watch/<id>/whep`, `/watch/<id>/stream`) for anyone who holds it."""

    id: str
    token: str
    url: str


def watch_of(fields: dict | None, base_url: str | None = None) -> Watch | None:
    """An opened (attached) summary's `watch` map as a Watch; its url, relative to the service's base
    URL, joined to `base_url` (the client's HTTP base, its route prefix kept) where there is one."""
    if not fields:
        return None
    url = fields["url"]
    if base_url and not urlsplit(url).scheme:
        url = str(base_url).rstrip("/") + "/" + url.lstrip("/")
    return Watch(fields["id"], fields["token"], url)


# ---- bookkeeping ----------------------------------------------------------------------------------
class SessionBook:
    """A session's state between messages, for both clients. `frames`/`latent_frames`: what was handed
    to the caller (and written to `path`). With `resume`, `kept` holds every applied chunk's message
    (its latents, copied: memory that grows with the session) to replay in a new session when this
    one is lost; `gone`: the error that ended the connection (the next chunk raises it again, or
    resumes)."""

    def __init__(self, settings: dict, resume: bool = False, path: str | Path | BinaryIO | None = None):
        if path is not None and settings["output"] not in VIDEO_OUTPUTS:
            raise refused_here("path", f"a file is written for output mp4 or webm, not {settings['output']!r}")
        if path is not None and settings.get("frames") == "none":
            raise refused_here("path", "a session opened with frames='none' is sent no fragments to write")
        self.settings, self.resume = settings, resume
        self.opened: dict = {}
        self.frames = self.latent_frames = self.resumes = 0
        self.kept: list[tuple[int, int, bytes]] = []  # (first latent frame, latent frames after, message)
        self.checkpointed = 0  # latent frames the server's latest checkpoint of the session holds
        self.replayed_latent_frames = 0  # latent frames sent again to resume (none across a drain)
        self.attaches = 0  # reconnections that continued the same session (moved, or from its checkpoint)
        self.gone: VaeServiceError | None = None
        self.closed: dict | None = None
        self.is_closed = False
        self._replayed = (0, 0)  # (frames, latent_frames) the replay has decoded again so far
        self._path, self._out, self._owned = path, None, False  # the file opens with the first fragment

    @property
    def session_id(self) -> str | None:
        return self.opened.get("session")

    @property
    def kept_bytes(self) -> int:
        """What `resume` holds on the client: the latents of every applied chunk after the latest
        checkpoint (every chunk's where the server takes none)."""
        return sum(len(message) for _, _, message in self.kept)

    def open_message(self) -> bytes:
        return pack({"open": self.settings})

    def attach_message(self) -> bytes:
        return pack({"attach": {"session": self.session_id, "latent_frames": self.latent_frames}})

    def take_attached(self, raw) -> int:
        """The answer to `attach`: the latent frames the session stands at there (the client's own
        after a drain's handoff; a checkpoint's, fewer, after its replica was lost), or its error."""
        kind, fields = unpack(raw)
        if kind == "error":
            raise answer_error(fields)
        if kind != "attached":
            raise make_error("internal", None, f"the server answered attach with {kind!r}, not 'attached'")
        self.opened, self.gone = {**self.opened, **fields}, None
        self.attaches += 1
        self.checkpointed = min(fields.get("checkpointed_latent_frames", 0), self.latent_frames)
        return fields["latent_frames"]

    def replay_from(self, latent_frame: int) -> list[bytes]:
        """The kept chunks that take a session standing at `latent_frame` back to where the client is
        (SessionLost where they are not all kept: the server went back past the latest checkpoint)."""
        replay = [(start, message) for start, _, message in self.kept if start >= latent_frame]
        if latent_frame < self.latent_frames and (not replay or replay[0][0] != latent_frame):
            raise make_error(
                "session_lost",
                None,
                f"the session continues from latent frame {latent_frame}, and the client no longer keeps the "
                f"latents from there (resume=True keeps those after the latest checkpoint): replay it in a new session",
            )
        self._replayed = (self.frames, latent_frame)  # what the replay starts from (check_replayed)
        return [message for _, message in replay]

    def take_opened(self, raw) -> dict:
        """The answer to `open`: the session's summary, or its error raised."""
        kind, fields = unpack(raw)
        if kind == "error":
            raise answer_error(fields)
        if kind != "opened":
            raise make_error("internal", None, f"the server answered open with {kind!r}, not 'opened'")
        self.opened, self.gone, self._replayed = fields, None, (0, 0)
        return fields

    def chunk_message(self, latents) -> bytes:
        if self.is_closed:
            raise refused_here("session", "it is closed; open a new session")
        return pack({"chunk": chunk_fields(latents, self.latent_frames, self.settings)})

    def answer(self, message: bytes) -> ChunkAnswer:
        return ChunkAnswer(self, message)

    def commit(self, message: bytes, done: dict, pixels: list, fragments: list) -> SessionChunk:
        """A chunk's `chunk_done`: the chunk as handed out; a replayed one (nothing new) only counted."""
        if done["latent_frames"] <= self.latent_frames:  # a resume's replay of a chunk handed out before
            self.replayed_latent_frames += done["latent_frames"] - done["latent_frame"]
            self._replayed = (done["frames"], done["latent_frames"])
        frame, latent_frame = self.frames, done["latent_frame"]
        chunk = SessionChunk(
            latent_frame,
            done["latent_frames"] - latent_frame,
            frame,
            max(0, done["frames"] - frame),
            _joined(pixels),
            b"".join(f["fragment"] for f in fragments) if self.settings["output"] in VIDEO_OUTPUTS else None,
            done.get("precision", ""),
            done.get("timing", {}),
            done.get("fallback_from_frame"),
        )
        if done["latent_frames"] > self.latent_frames:
            self.frames, self.latent_frames = done["frames"], done["latent_frames"]
            if self.resume:
                self.kept.append((latent_frame, done["latent_frames"], message))
            if self._path is not None and chunk.fragment:
                self._write(chunk.fragment)
        self.checkpointed = max(self.checkpointed, min(done.get("checkpointed_latent_frames", 0), self.latent_frames))
        self.kept = [k for k in self.kept if k[1] > self.checkpointed]  # the server keeps the rest
        return chunk

    def _write(self, fragment: bytes) -> None:
        if self._out is None:
            self._out, self._owned = open_target(self._path)
        self._out.write(fragment)
        self._out.flush()  # a player reading the file follows the session

    def check_replayed(self) -> None:
        """After the replay: the new session stands where the lost one did, else its frames would not
        continue the caller's."""
        if self._replayed != (self.frames, self.latent_frames):
            frames, latent_frames = self._replayed
            raise make_error(
                "session_lost",
                None,
                f"the replay decoded {frames} frames of {latent_frames} latent frames, not the {self.frames} of "
                f"{self.latent_frames} handed out; replay the latents in a new session",
            )

    def lost(self, exc: ConnectionClosed | None, url: str, why: str = "") -> VaeServiceError:
        """The connection dropped without `closed` (the replica died or restarted, the network cut):
        the session's causal cache is gone, whatever the close code said (SessionLost). A close with
        1009 says the chunk's message was over the server's message limit: that chunk raises 413
        naming `latents` (it would fail again; no resume), the next one SessionLost (or resumes)."""
        where = "before its first frame" if not self.frames else f"after frame {self.frames - 1}"
        how = why or f"the connection to {url} closed ({exc})"
        error = make_error(
            "session_lost",
            None,
            f"{how}: session {self.session_id} lost {where} ({self.frames} frames, {self.latent_frames} latent frames "
            "received); resume with resume=True or replay the latents in a new session",
        )
        self.gone = error
        rcvd = getattr(exc, "rcvd", None)
        if rcvd is not None and rcvd.code == MESSAGE_TOO_BIG:  # the chunk itself was over the server's limit
            return make_error(
                "payload_too_large",
                "latents",
                f"the chunk's message was over the server's WebSocket message limit (it closed the connection "
                f"with 1009: {rcvd.reason or 'message too big'}); send fewer latent frames per chunk. "
                f"The connection is gone with session {self.session_id} ({self.frames} frames received): "
                "the next chunk raises SessionLost, or resumes with resume=True",
            )
        return error

    def raise_if_gone(self) -> None:
        if self.gone is not None:
            raise make_error(self.gone.type, self.gone.field, self.gone.message)

    @contextlib.contextmanager
    def resuming(self, lost: VaeServiceError) -> Iterator[None]:
        """One resume attempt: counted; should it fail, the session stays gone (the next chunk tries
        again from the start) and the error says which loss it was resuming."""
        self.resumes += 1
        try:
            yield
        except BaseException as exc:
            self.gone = self.gone or lost  # the new session's error, or the loss being resumed
            if isinstance(exc, VaeServiceError):
                exc.add_note(f"while resuming (resume {self.resumes}) after: {lost}")
            raise

    def take_closed(self, raw) -> dict | None:
        kind, fields = unpack(raw)
        if kind == "error":
            if fields.get("type") == "session_expired":  # every chunk's answer arrived: nothing lost
                return None
            raise answer_error(fields)
        self.closed = fields
        return fields

    def release(self) -> None:
        self.is_closed = True
        if self._owned:
            self._out.close()
            self._owned = False


class ChunkAnswer:
    """One chunk's answer as its messages arrive: `feed` each; it returns the SessionChunk at
    `chunk_done` (None before) and raises an `error` message as its typed exception."""

    def __init__(self, book: SessionBook, message: bytes):
        self.book, self.message = book, message
        self.pixels: list[tuple[int, np.ndarray]] = []
        self.fragments: list[dict] = []

    def feed(self, raw) -> SessionChunk | None:
        kind, fields = unpack(raw)
        seen = self.book.frames
        if kind == "pixels":
            pixels = decode_tensor(fields["pixels"], "pixels").to_numpy()
            if (kept := trim_pixels(fields["frame"], pixels, seen)) is not None:
                self.pixels.append(kept)
        elif kind == "fragment":
            self.fragments += new_fragments([fields], seen)
        elif kind == "chunk_done":
            return self.book.commit(self.message, fields, self.pixels, self.fragments)
        elif kind == "moved":
            raise moved_error(self.book)
        elif kind == "error":
            error = answer_error(fields)
            if isinstance(error, SessionExpired | SessionLost):
                self.book.gone = error
            raise error
        else:
            raise make_error("internal", None, f"the server answered a chunk with {kind!r}")
        return None


def said_moved(messages: list) -> bool:
    """Whether the messages left on a closed connection include the server's `moved`."""
    for raw in messages:
        with contextlib.suppress(VaeServiceError):
            if unpack(raw)[0] == "moved":
                return True
    return False


def _buffered(ws) -> list:
    """The messages a closed sync socket had received and not handed out yet."""
    messages = []
    with contextlib.suppress(Exception):
        while True:
            messages.append(ws.recv(timeout=0))
    return messages


async def _buffered_async(ws) -> list:
    messages = []
    with contextlib.suppress(Exception):
        while True:
            messages.append(await asyncio.wait_for(ws.recv(), 0.05))
    return messages


def moved_error(book: SessionBook) -> SessionMoved:
    """The server's `moved`: the session left its replica (a drain) and waits to be attached to."""
    book.gone = make_error(
        "session_moved", "session", f"session {book.session_id} moved off its replica (it drains): attach to it"
    )
    return book.gone


def _joined(pixels: list[tuple[int, np.ndarray]]) -> np.ndarray | None:
    if not pixels:
        return None
    arrays = [p for _, p in sorted(pixels, key=lambda fp: fp[0])]
    axis = 1 if arrays[0].dtype == np.uint8 else 2
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=axis)


# ---- transport ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionLink:
    """Where and how a client reaches `/sessions`: its URL, the handshake's headers (the bearer token),
    `timeout` (seconds to connect, and per answer), and the retry policy of the open and of chunks
    answered `overloaded` or `out_of_memory` (retries.py: the session is unchanged by those).
    `connect`/`connect_async` give the socket the sessions speak through (send, recv, close; a
    dropped one raises ConnectionClosed): a WebSocket here, a DecodeSession call in grpc_sessions.py."""

    url: str
    headers: dict
    timeout: float = 120.0
    retries: int = 3
    backoff_s: float = 0.5
    http_base: str | None = None  # the service's HTTP base URL, a watch url's base (None: it stays relative)

    @property
    def where(self) -> str:
        return f"WebSocket {self.url}"

    def connect(self, session: str | None = None):
        """A new socket; `session`: the id of the session it continues (routed to its replica)."""
        return connect(self.url, **self.options(session))

    async def connect_async(self, session: str | None = None):
        return await connect_async(self.url, **self.options(session))

    def connect_error(self, exc: BaseException) -> VaeServiceError | None:
        return connect_error(exc, self)

    def options(self, session: str | None = None) -> dict:
        # frames of a long chunk exceed websockets' 1 MiB default; raw tensors do not deflate: no compression
        headers = self.headers if session is None else {**self.headers, SESSION_HEADER: session}
        return dict(
            additional_headers=headers,
            open_timeout=self.timeout,
            max_size=MAX_MESSAGE_BYTES,
            compression=None,
        )


def connect_error(exc: BaseException, link: SessionLink) -> VaeServiceError | None:
    """The handshake's failure as the clients' typed error (None: not a connection failure)."""
    where = link.where
    if isinstance(exc, InvalidStatus):  # an HTTP answer in place of the upgrade (401, 404, 503, ...)
        response = exc.response
        return error_from_http(response.status_code, response.headers, response.body or b"")
    if isinstance(exc, ConnectionRefusedError):
        return connection_error(ServiceUnreachable, "unreachable", where, "connection refused (nothing listening)")
    if isinstance(exc, TimeoutError):
        return connection_error(
            ServiceUnreachable, "unreachable", where, f"timed out connecting (timeout={link.timeout} s)"
        )
    if isinstance(exc, InvalidURI):
        return connection_error(ServiceUnreachable, "unreachable", where, str(exc))
    if isinstance(exc, InvalidHandshake | ConnectionClosed):
        return connection_error(
            Unavailable, "unavailable", where, f"the connection closed during the WebSocket handshake ({exc})"
        )
    if isinstance(exc, OSError):
        return connection_error(ServiceUnreachable, "unreachable", where, f"cannot connect ({exc})")
    return None


def open_failed(exc: ConnectionClosed | TimeoutError, link: SessionLink) -> VaeServiceError:
    """No answer to `open`: the connection closed first (Unavailable: retried), or nothing came within
    `timeout` (DecodeTimeout)."""
    where = link.where
    if isinstance(exc, TimeoutError):
        return connection_error(DecodeTimeout, "timeout", where, f"no answer to open within timeout={link.timeout} s")
    return connection_error(
        Unavailable, "unavailable", where, f"the connection closed before the session opened ({exc})"
    )


def timed_out(link: SessionLink, book: SessionBook) -> DecodeTimeout:
    """No answer within `timeout`: the connection is closed (whether the chunk was applied is unknown),
    so the session is gone: the next chunk raises SessionLost, or resumes."""
    book.lost(None, link.url, f"no answer within timeout={link.timeout} s, so the connection was closed")
    return connection_error(DecodeTimeout, "timeout", link.where, f"nothing received within timeout={link.timeout} s")


class _Session:
    """What both session clients show of their SessionBook."""

    _book: SessionBook

    @property
    def frames(self) -> int:
        """Frames decoded so far (the next chunk's first frame): handed out, unless opened with frames="none"."""
        return self._book.frames

    @property
    def latent_frames(self) -> int:
        """Latent frames applied so far (the next chunk's `latent_frame`)."""
        return self._book.latent_frames

    @property
    def session_id(self) -> str | None:
        return self._book.session_id

    @property
    def opened(self) -> dict:
        """The server's `opened` summary (of the latest session, after a resume)."""
        return self._book.opened

    @property
    def watch(self) -> Watch | None:
        """How viewers watch the session (opened with watch=True; None otherwise, or not open yet);
        its url absolute where the client knows the service's HTTP base URL. A resume that opens a
        new session gives a new id, token and url (the old one's viewers see it end)."""
        return watch_of(self._book.opened.get("watch"), self._link.http_base)

    @property
    def resumes(self) -> int:
        return self._book.resumes

    @property
    def closed(self) -> dict | None:
        """The `closed` summary, once closed (None before, or where the connection was gone)."""
        return self._book.closed

    @property
    def kept_bytes(self) -> int:
        """Client memory that `resume` holds: the latents of the applied chunks after the latest
        checkpoint the server took of the session."""
        return self._book.kept_bytes

    @property
    def replayed_latent_frames(self) -> int:
        """Latent frames sent again to resume the session (0 across a drain: it moves whole)."""
        return self._book.replayed_latent_frames

    @property
    def attaches(self) -> int:
        """Times the session was continued on another replica (it moved, or resumed from its checkpoint)."""
        return self._book.attaches


class DecodeSession(_Session):
    """A decode session over WebSocket, open once constructed (VaeClient.session): `decode(chunk)`
    sends latents [1, C, t, H, W] (numpy or torch, of the session's dtype and latent size) and returns
    its SessionChunk; `close()` (idempotent; the `with` block's end) returns the `closed` summary.

    `frames`, `latent_frames`: the session's so far (handed out); `session_id`, `opened` (the server's
    summary: model, precision, idle_timeout_s, max_chunk_latent_frames, ...); `resumes`; `closed`.
    With `path` (output mp4/webm) each chunk's fragments are appended to that file (and flushed) as
    the chunk is answered: together they are one playable file, which a player can follow. The
    `closed` summary's `trailer` (the box, or element, a streamed answer ends with) is not written:
    the file holds the media, as decode_video's does.

    A chunk refused (an `error`: invalid_request, payload_too_large, decode_failed, timeout) raises
    its typed error and leaves the session as it was: send a corrected chunk. `overloaded` and
    `out_of_memory` are retried with backoff first (retries.py), as the open is. A socket that drops
    without `closed` (the replica died or restarted, the network cut; whatever the close code: the
    server frees a session whose connection ends) raises SessionLost, naming the last frame
    received; a session idle past the service's `sessions.idle_timeout_s` raises SessionExpired.

    `resume=True` survives both. The session keeps every applied chunk's latents (client memory that
    grows with the session: `kept_bytes`); on SessionLost or SessionExpired it opens a new session
    with the same settings (frames and watch too: `watch` then names the new session), replays them
    in order (the server decodes the whole session again: a resume costs as much as every chunk
    before it), drops the frames and fragments already handed
    out (the replay's are identical: the decode and the encoders are deterministic), then sends the
    chunk that failed and returns its answer as if nothing had happened. Expiry is resumed too: the
    kept latents recover it exactly as a loss (a caller slower than the idle timeout pays a replay
    per chunk: watch `resumes`). One attempt per failure: a loss while resuming raises, and the next
    chunk tries again. A DecodeTimeout is not resumed (the replay would take longer still): it closes
    the connection, and the next chunk resumes (or raises SessionLost)."""

    def __init__(self, link: SessionLink, book: SessionBook):
        self._link, self._book, self._ws = link, book, None
        try:
            self._open()
        except BaseException:
            book.release()
            raise

    def decode(self, latents) -> SessionChunk:
        message = self._book.chunk_message(latents)
        try:
            self._book.raise_if_gone()
            try:
                return self._chunk(message)
            except SessionMoved:
                return self._follow(message)
        except (SessionLost, SessionExpired) as lost:  # a move that could not be followed too
            if not self._book.resume:
                raise
            return self._resume(message, lost)

    def iter_decode(self, chunks: Iterable) -> Iterator[SessionChunk]:
        """Each chunk decoded in turn, its answer yielded before the next is sent."""
        for chunk in chunks:
            yield self.decode(chunk)

    def close(self) -> dict | None:
        """Ends the session: the `closed` summary ({frames, latent_frames[, trailer]}), or None where
        the connection was gone already (every answer handed out had arrived: nothing is lost)."""
        if self._book.is_closed:
            return self._book.closed
        ws, self._ws = self._ws, None
        try:
            if ws is not None and self._book.gone is None:
                with contextlib.suppress(ConnectionClosed, TimeoutError):
                    ws.send(CLOSE)
                    self._book.take_closed(ws.recv(timeout=self._link.timeout))
        finally:
            if ws is not None:
                ws.close()
            self._book.release()
        return self._book.closed

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller's error or the session's: no `close` exchange, the disconnect frees it
            self._abandon()
            self._book.release()

    def _open(self) -> None:
        def attempt() -> None:
            try:
                self._ws = self._link.connect()
            except Exception as exc:
                raise self._link.connect_error(exc) or exc from None
            try:
                self._ws.send(self._book.open_message())
                self._book.take_opened(self._ws.recv(timeout=self._link.timeout))
            except (ConnectionClosed, TimeoutError) as exc:
                self._abandon()
                raise open_failed(exc, self._link) from None
            except BaseException:
                self._abandon()
                raise

        with_retries(attempt, self._link.retries, self._link.backoff_s)

    def _follow(self, message: bytes) -> SessionChunk:
        """The session moved off its draining replica: attach to it where it went, then send the
        chunk (not applied where it was refused)."""
        self._abandon()
        try:
            for kept in self._book.replay_from(self._attach()):
                self._chunk(kept)
        except BaseException:
            self._abandon()
            raise
        return self._chunk(message)

    def _resume(self, message: bytes, lost: VaeServiceError) -> SessionChunk:
        with self._book.resuming(lost):
            self._abandon()
            try:
                for kept in self._book.replay_from(self._attach_or_open()):
                    self._chunk(kept)
                self._book.check_replayed()
            except BaseException:
                self._abandon()
                raise
        return self._chunk(message)  # a loss now raises: one resume per failure

    def _attach_or_open(self) -> int:
        """Where the resumed session stands: attached (from its latest checkpoint, or where it
        moved: a connection lost, or a session expired on its replica), else a new session (the
        replay from the start: where none was kept and the client still has every latent)."""
        if self._book.session_id is not None:
            try:
                return self._attach()
            except (SessionLost, SessionExpired):
                if self._book.checkpointed:
                    raise  # the latents before the checkpoint are gone here too: nothing to replay
        self._open()
        return 0

    def _attach(self) -> int:
        def attempt() -> int:
            try:
                self._ws = self._link.connect(self._book.session_id)
            except Exception as exc:
                raise self._link.connect_error(exc) or exc from None
            try:
                self._ws.send(self._book.attach_message())
                return self._book.take_attached(self._ws.recv(timeout=self._link.timeout))
            except (ConnectionClosed, TimeoutError) as exc:
                self._abandon()
                raise open_failed(exc, self._link) from None
            except BaseException:
                self._abandon()
                raise

        link = self._link
        return with_retries(attempt, link.retries, link.backoff_s, (Overloaded, SessionMoved))

    def _chunk(self, message: bytes) -> SessionChunk:
        return with_retries(lambda: self._exchange(message), self._link.retries, self._link.backoff_s)

    def _exchange(self, message: bytes) -> SessionChunk:
        answer = self._book.answer(message)
        try:
            self._ws.send(message)
            while (chunk := answer.feed(self._ws.recv(timeout=self._link.timeout))) is None:
                pass
        except ConnectionClosed as exc:
            ws, self._ws = self._ws, None
            if said_moved(_buffered(ws)):  # the session moved before the chunk went: send it there
                raise moved_error(self._book) from None
            raise self._book.lost(exc, self._link.url) from None
        except TimeoutError:
            self._abandon()
            raise timed_out(self._link, self._book) from None
        except (SessionLost, SessionExpired):  # answered: the server closes the connection after it
            self._abandon()
            raise
        return chunk

    def _abandon(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()


class AsyncDecodeSession(_Session):
    """DecodeSession for asyncio (AsyncVaeClient.session), with the same behaviour; opened by
    `async with` or by awaiting it (`s = await client.session(...)`), else by its first `decode`."""

    def __init__(self, link: SessionLink, book: SessionBook):
        self._link, self._book, self._ws = link, book, None

    async def open(self) -> AsyncDecodeSession:
        if not self._book.opened and not self._book.is_closed:
            try:
                await self._open()
            except BaseException:
                self._book.release()
                raise
        return self

    def __await__(self):
        return self.open().__await__()

    async def decode(self, latents) -> SessionChunk:
        message = self._book.chunk_message(latents)
        await self.open()
        try:
            self._book.raise_if_gone()
            try:
                return await self._chunk(message)
            except SessionMoved:
                return await self._follow(message)
        except (SessionLost, SessionExpired) as lost:
            if not self._book.resume:
                raise
            return await self._resume(message, lost)

    async def iter_decode(self, chunks: Iterable | AsyncIterable) -> AsyncIterator[SessionChunk]:
        """Each chunk (of an iterable or an async iterable) decoded in turn, its answer yielded."""
        if not isinstance(chunks, AsyncIterable):
            chunks = _aiter(chunks)
        async for chunk in chunks:
            yield await self.decode(chunk)

    async def close(self) -> dict | None:
        """Like DecodeSession.close."""
        if self._book.is_closed:
            return self._book.closed
        ws, self._ws = self._ws, None
        try:
            if ws is not None and self._book.gone is None:
                with contextlib.suppress(ConnectionClosed, TimeoutError):
                    await ws.send(CLOSE)
                    self._book.take_closed(await self._recv(ws))
        finally:
            if ws is not None:
                await ws.close()
            self._book.release()
        return self._book.closed

    async def __aenter__(self) -> AsyncDecodeSession:
        return await self.open()

    async def __aexit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self._abandon()
            self._book.release()

    async def _open(self) -> None:
        async def attempt() -> None:
            try:
                self._ws = await self._link.connect_async()
            except Exception as exc:
                raise self._link.connect_error(exc) or exc from None
            try:
                await self._ws.send(self._book.open_message())
                self._book.take_opened(await self._recv(self._ws))
            except (ConnectionClosed, TimeoutError) as exc:
                await self._abandon()
                raise open_failed(exc, self._link) from None
            except BaseException:
                await self._abandon()
                raise

        await with_retries_async(attempt, self._link.retries, self._link.backoff_s)

    async def _follow(self, message: bytes) -> SessionChunk:
        await self._abandon()
        try:
            for kept in self._book.replay_from(await self._attach()):
                await self._chunk(kept)
        except BaseException:
            await self._abandon()
            raise
        return await self._chunk(message)

    async def _resume(self, message: bytes, lost: VaeServiceError) -> SessionChunk:
        with self._book.resuming(lost):
            await self._abandon()
            try:
                for kept in self._book.replay_from(await self._attach_or_open()):
                    await self._chunk(kept)
                self._book.check_replayed()
            except BaseException:
                await self._abandon()
                raise
        return await self._chunk(message)

    async def _attach_or_open(self) -> int:
        if self._book.session_id is not None:
            try:
                return await self._attach()
            except (SessionLost, SessionExpired):
                if self._book.checkpointed:
                    raise
        await self._open()
        return 0

    async def _attach(self) -> int:
        async def attempt() -> int:
            try:
                self._ws = await self._link.connect_async(self._book.session_id)
            except Exception as exc:
                raise self._link.connect_error(exc) or exc from None
            try:
                await self._ws.send(self._book.attach_message())
                return self._book.take_attached(await self._recv(self._ws))
            except (ConnectionClosed, TimeoutError) as exc:
                await self._abandon()
                raise open_failed(exc, self._link) from None
            except BaseException:
                await self._abandon()
                raise

        link = self._link
        return await with_retries_async(attempt, link.retries, link.backoff_s, (Overloaded, SessionMoved))

    async def _chunk(self, message: bytes) -> SessionChunk:
        return await with_retries_async(lambda: self._exchange(message), self._link.retries, self._link.backoff_s)

    async def _exchange(self, message: bytes) -> SessionChunk:
        answer = self._book.answer(message)
        try:
            await self._ws.send(message)
            while (chunk := answer.feed(await self._recv(self._ws))) is None:
                pass
        except ConnectionClosed as exc:
            ws, self._ws = self._ws, None
            if said_moved(await _buffered_async(ws)):
                raise moved_error(self._book) from None
            raise self._book.lost(exc, self._link.url) from None
        except TimeoutError:
            await self._abandon()
            raise timed_out(self._link, self._book) from None
        except (SessionLost, SessionExpired):
            await self._abandon()
            raise
        return chunk

    async def _recv(self, ws):
        async with asyncio.timeout(self._link.timeout):  # per message, as the sync client's recv(timeout)
            return await ws.recv()

    async def _abandon(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()


class SessionOpener:
    """`session(...)` for every client: each gives `_session_link()` (how it reaches a session) and
    `_session_class` (DecodeSession for the sync clients, AsyncDecodeSession for the async ones)."""

    _session_class: type = DecodeSession

    def _session_link(self) -> SessionLink:
        raise NotImplementedError

    def session(
        self,
        height: int,
        width: int,
        quality: str = "lossless",
        output: str = "uint8",
        dtype: str = "float32",
        resume: bool = False,
        path: str | Path | BinaryIO | None = None,
        frames: str = "all",
        watch: bool = False,
        **options,
    ):
        """A decode session: a video decoded chunk by chunk (`decode(latents [1, C, t, H, W])`), each
        chunk continuing the clip the chunks before it began; the sync clients' is open when this
        returns, the async clients' opens with `async with` or when awaited. `height`/`width`: the
        latents' (every chunk's); `dtype`: the chunks' (float32, float16, bfloat16); `output`: uint8 or
        float frames, or mp4/webm fragments of one file (`path`: appended to that file as they
        arrive); `frames="none"`: each chunk answers its counts and timing alone, no frames (as
        viewers watch it); `watch=True` (mp4/webm): viewers may watch it, `session.watch` says how;
        options: scaling_factor, shift_factor (None = already scaled), model, request_id,
        clip_latent_frames, priority (the chunks' scheduler class; None: the server's default).
        `resume=True`: a lost or expired session is replayed in a new one from
        latents the client keeps (DecodeSession says what that costs). Settings the client depends on
        are refused here, before any I/O."""
        fields = open_fields(height, width, quality, output, dtype, frames, watch, **options)
        book = SessionBook(fields, resume, path)
        return self._session_class(self._session_link(), book)


async def _aiter(items: Iterable) -> AsyncIterator:
    for item in items:
        yield item


__all__ = [
    "SESSION_OUTPUTS",
    "AsyncDecodeSession",
    "DecodeSession",
    "SessionBook",
    "SessionChunk",
    "SessionLink",
    "SessionOpener",
    "Watch",
    "chunks_of",
    "open_fields",
    "ws_url",
]
