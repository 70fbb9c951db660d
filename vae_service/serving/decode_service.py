"""The framework-free core of a decode replica: one engine (model, precision and device fixed
for the replica's life), tier-keyed batching with serialised device work off the event loop,
timing, and the live settings (limits, batching). The Serve deployment and the tests drive it.

Each request gets its RequestContext (engine/request/context.py) when it arrives here: its deadline from the
live `batching.request_timeout_s` of that moment, its live limits, the engine's fingerprint. Every
stage after it (parsing and checking, pricing, the queue, the device, the host copy, the encoders)
keeps to that one deadline, and a caller that goes away marks it abandoned, which stops them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from vae_service.config import LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, DecodeResult, PreparedRequest
from vae_service.engine.execution.peer_contract import TilePeers
from vae_service.engine.execution.session import ChunkFrames, SessionChunk
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.decode_request import VIDEO_OUTPUTS
from vae_service.engine.request.errors import DecodeTimeout, InvalidInput, LimitExceeded, OutOfMemory, Overloaded
from vae_service.engine.request.result import PendingResult
from vae_service.engine.runtime.tile_jobs import TileJob
from vae_service.names import PRIORITIES
from vae_service.serving.outputs.encoders import EncoderPool
from vae_service.serving.outputs.frame_stream import FrameStream
from vae_service.serving.outputs.sinks import Sinks
from vae_service.serving.outputs.video_stream import VideoStream
from vae_service.serving.scheduling.classes import request_class
from vae_service.serving.scheduling.device_turns import StepPrice, Turn
from vae_service.serving.scheduling.request_pricing import RequestPricing
from vae_service.serving.scheduling.scheduler import (
    BatchStats,
    DeadlineExceeded,
    NeverFits,
    QueueFull,
    SchedulerLimits,
    StepScheduler,
)
from vae_service.serving.scheduling.tile_surface import TileSurface
from vae_service.serving.sessions.registry import SessionRegistry


def scheduler_limits(config: ServiceConfig, engine: DecodeEngine) -> SchedulerLimits:
    b, s = config.batching, config.scheduling
    return SchedulerLimits(
        b.max_batch_size,
        b.batch_wait_ms,
        b.max_queued_items,
        config.serving.retry_after_s,
        dict(s.queued_items),
        s.preemption,
        s.promote_after_s,
        s.max_suspended,
        engine.cost.bound(config.limits),
        s.suspended_bytes,
    )


def with_preempted_time(result, preempted_ms: float):
    """A result whose decode was suspended for `preempted_ms`: its timing says so, and its
    decode_ms is the device time its own steps took."""
    if isinstance(result, PendingResult):
        return PendingResult(with_preempted_time(result.result, preempted_ms), result.copied)
    if isinstance(result, DecodeResult):
        t = result.timing
        return replace(
            result, timing=replace(t, decode_ms=max(0.0, t.decode_ms - preempted_ms), preempted_ms=preempted_ms)
        )
    if isinstance(result, ChunkFrames):
        return replace(result, decode_ms=max(0.0, result.decode_ms - preempted_ms), preempted_ms=preempted_ms)
    return result


class DecodeService:
    def __init__(
        self,
        config: ServiceConfig,
        engine: DecodeEngine | None = None,
        on_batch: Callable[[BatchStats], None] | None = None,
        on_rejected: Callable[[BaseException], None] | None = None,
        on_decoded: Callable[[DecodeResult], None] | None = None,
        on_first_frames: Callable[[str, float], None] | None = None,
        peers: TilePeers | None = None,
        owner: Callable[[], str] = lambda: "local",
    ):
        """`owner`: this replica's id, the prefix of its sessions' ids (serving/scheduling/session_router.py)."""
        self.config = config
        self.engine = engine or DecodeEngine(config)
        self.peers = peers  # tiled requests share their tiles with these (serving/scheduling/tile_peers.py)
        # a device thread per started batch (the one running a step and those suspended) and one for
        # another replica's tile, each set up once like the engine wants (torch's CPU thread count);
        # the scheduler's turns let one step run at a time
        self.device_threads = ThreadPoolExecutor(
            config.scheduling.max_suspended + 2, thread_name_prefix="vae-device", initializer=self.engine.bind_thread
        )
        serving = config.serving
        self.pricing = RequestPricing(self.engine, serving.retry_after_s, serving.fit_prices_at_start)
        self.scheduler: StepScheduler[PreparedRequest | SessionChunk] = StepScheduler(
            self._decode_batch,
            scheduler_limits(config, self.engine),
            self._observe,
            executor=self.device_threads,
            price=lambda request: StepPrice(*self.engine.step_price([request])),
        )
        self.encoders = EncoderPool(self.engine.encode_settings, config.encoding.threads)
        self.sinks = Sinks(config.sinks, serving.retry_after_s)  # object storage a request may name
        self.on_batch, self.on_rejected = on_batch, on_rejected
        self.on_decoded, self.on_first_frames = on_decoded, on_first_frames  # (quality, ms)
        self.decoded_items = 0  # latent items that reached the device (requests given up on never do)
        self.tiles = TileSurface(self.engine, self.scheduler, self._device_busy, lambda: self.config.limits)
        self.sessions = SessionRegistry(self, owner)
        self.session_moves = None  # sessions leaving and coming (sessions/handoff.py: a replica with a keeper)

    def _decode_batch(self, batch: list[PreparedRequest | SessionChunk], abandoned, turn: Turn) -> list:
        # without preemption one batch runs at a time: nothing to take turns with
        steps, suspended_before = (turn if self.scheduler.limits.preemption else None), turn.suspended_s
        if isinstance(batch[0], SessionChunk):  # a batch key never mixes sessions' chunks with requests
            results = self.engine.decode_session_chunks(batch, abandoned, steps=steps)
        else:
            # the device takes its next step while this batch's output is still copied to the host
            # (CUDA); the wait happens in _decode_prepared, off the device threads
            results = self.engine.decode(batch, abandoned, defer_host_copy=True, peers=self.peers, steps=steps)
        if suspended := turn.suspended_s - suspended_before:  # this try's (a batch retried item by item)
            results = [with_preempted_time(r, suspended * 1e3) for r in results]
        return results

    def _observe(self, stats: BatchStats) -> None:
        self.decoded_items += stats.items
        if self.on_batch is not None:
            self.on_batch(stats)

    def rejected(self, exc: BaseException) -> BaseException:
        """Every request answered with an error passes here (metrics count them by type)."""
        if self.on_rejected is not None:
            self.on_rejected(exc)
        return exc

    @property
    def live(self) -> LiveConfig:
        return self.config.live()

    def apply(self, live: LiveConfig) -> None:
        """Limits and batching, in place; every other setting is fixed for the replica's life.
        Requests already admitted keep the settings they were admitted under."""
        self.config = self.config.with_live(live)
        self.engine.limits = live.limits
        self.scheduler.update(scheduler_limits(self.config, self.engine))

    def admit(self) -> RequestContext:
        """A request arriving now: its deadline and limits from the live settings of this moment."""
        config = self.config  # read once: reconfigure swaps it
        return RequestContext.admit(config.batching.request_timeout_s, config.limits, self.engine.fingerprint)

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        return await self.decode_from(lambda: request, request.latents.nbytes)

    async def decode_from(self, parse: Callable[[], DecodeRequest], size: int) -> DecodeResult:
        """Parse and check a request (off the event loop when `size` bytes are many), then queue it
        for its batch. Raises the engine's DecodeError kinds."""
        prepared = await self._prepare(parse, size)
        if prepared.request.stream:
            raise InvalidInput("stream", "this call answers whole outputs; stream frames with the streaming call")
        return await self._decode_prepared(prepared)

    async def submit(self, parse: Callable[[], DecodeRequest], size: int) -> DecodeResult | FrameStream | VideoStream:
        """Like decode_from, but a request with `stream` set comes back as a FrameStream (output
        mp4 or webm: a VideoStream) once its first frames are decoded (errors before them are raised here)."""
        arrived = time.perf_counter()
        prepared = await self._prepare(parse, size)
        if not prepared.request.stream:
            return await self._decode_prepared(prepared)
        frames = FrameStream(prepared.items, prepared.context)
        decode = asyncio.ensure_future(self._decode_prepared(replace(prepared, sink=frames.sink)))
        stream = frames
        output = prepared.request.output
        if output in VIDEO_OUTPUTS:
            stream = VideoStream(frames, self.encoders, output, self.engine.video_fragments(prepared), prepared.context)
        await stream.start(decode)
        if self.on_first_frames is not None:
            self.on_first_frames(prepared.request.quality, (time.perf_counter() - arrived) * 1e3)
        return stream

    async def _prepare(self, parse: Callable[[], DecodeRequest], size: int) -> PreparedRequest:
        def parse_checked() -> DecodeRequest:  # its sink, key and class too, before anything is decoded
            request = self.sinks.check(parse())
            request_class(request.priority, self.config.scheduling)
            return request

        return await self.pricing.prepare(parse_checked, size, self.admit(), self.config.batching.max_queued_items)

    async def _decode_prepared(self, prepared: PreparedRequest) -> DecodeResult:
        arrived, context = time.perf_counter(), prepared.context
        if self.peers is not None and getattr(self.peers, "loop", False) is None:
            self.peers.loop = asyncio.get_running_loop()  # where its tiles' answers are read
        priority = request_class(prepared.request.priority, self.config.scheduling)
        result = await self.submit_prepared(prepared, context, priority)
        if isinstance(result, PendingResult):
            await asyncio.to_thread(context.wait_until, result.copied, "the copy to the host")
            result = result.result
        if self.on_decoded is not None:
            self.on_decoded(result)
        decoded_ms, t = (time.perf_counter() - arrived) * 1e3, result.timing
        result = replace(result, timing=replace(t, queue_ms=max(0.0, decoded_ms - t.decode_ms - t.preempted_ms)))
        if result.encode_as is None:  # raw pixels: nothing to encode
            return result
        try:
            result = await asyncio.wait_for(self.encoders.finish(result), context.remaining())
        except TimeoutError:
            raise DecodeTimeout("output", "not encoded within request_timeout_s") from None
        if prepared.request.sink is not None:  # the files to object storage, within the same deadline
            result = await self.sinks.store(result, prepared.request, context)
        return result

    async def submit_prepared(self, item: PreparedRequest | SessionChunk, context: RequestContext, priority: str):
        """Queue a checked request (or a session's chunk) for its batch in its class; its answer, or
        the error it is answered with (an Exception the batch put in its place is raised)."""
        finished = False
        try:
            result = await self.scheduler.submit(item, context.remaining(), priority)
            finished = True
        except NeverFits as exc:
            raise LimitExceeded("latents", f"{exc}: send fewer items (scheduling.queued_items)") from None
        except QueueFull as exc:
            raise Overloaded(
                "priority", f"the {exc.priority} decode queue is full ({exc}); retry later", exc.retry_after_s
            ) from None
        except DeadlineExceeded as exc:
            raise DecodeTimeout("body", f"not decoded within request_timeout_s: {exc}") from None
        except torch.OutOfMemoryError:
            raise OutOfMemory(
                "latents",
                "the device ran out of memory for this request; retry later or send fewer items",
                self.config.serving.retry_after_s,
            ) from None
        finally:
            if not finished and not context.expired:
                context.abandon()  # the caller left (cancelled): its tiles and waits stop
        return result

    # ---- a tile of another replica's request -------------------------------------------------
    def tile(self, job: TileJob, fingerprint: str, remaining_s: float, replica: str) -> AsyncIterator:
        """A tile another replica offers (serving/scheduling/tile_surface.py)."""
        return self.tiles.tile(job, fingerprint, remaining_s, replica)

    def _device_busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.queued_items())

    def describe(self) -> dict:
        return {
            **self.engine.describe(),
            "batching": self.config.batching.model_dump(),
            "queued_items": self.scheduler.queued_items(),
            "running_batches": self.scheduler.running,
            "scheduling": self.describe_scheduling(),
            "decoded_items": self.decoded_items,
            "sinks": self.sinks.names,
            "sink_writes": self.sinks.describe(),
            "sessions": self.sessions.describe(),
        }

    def routing_stats(self) -> dict:
        """What the deployment's request router ranks replicas by (serving/scheduling/class_router.py):
        latent items queued or started here, per class."""
        scheduler = self.scheduler
        return {"items": {c: scheduler.queued_items(c) + scheduler.started_items(c) for c in PRIORITIES}}

    def describe_scheduling(self) -> dict:
        scheduler, limits = self.scheduler, self.scheduler.limits
        return {
            "preemption": limits.preemption,
            "queued_items": {c: scheduler.queued_items(c) for c in PRIORITIES},
            "queued_items_limit": {c: limits.class_bound(c) for c in PRIORITIES},
            "started_batches": scheduler.running,
            "suspended_bytes": scheduler.suspended_bytes(),
            "suspended_bytes_limit": limits.suspended_room,
            "max_suspended": limits.max_suspended,
            "promote_after_s": limits.promote_after_s,
            "classes": scheduler.stats.describe(),
        }

    def release_folded(self) -> int:
        return self.engine.release_folded()

    async def drain(self, timeout_s: float) -> bool:
        """Let queued and running batches finish (shutdown); False if they did not in time."""
        drained = await self.scheduler.drain(timeout_s)
        self.sessions.close_all()
        self.device_threads.shutdown(wait=False)
        self.pricing.shutdown()
        self.encoders.shutdown()
        self.sinks.shutdown()
        return drained
