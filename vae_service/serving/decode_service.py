"""The framework-free core of a decode replica: one engine (model, precision and device fixed
for the replica's life), tier-keyed batching with serialised device work off the event loop,
timing, and the live settings (limits, batching). The Serve deployment and the tests drive it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from vae_service.config import LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, DecodeResult, PreparedRequest
from vae_service.engine.errors import DecodeTimeout, InvalidInput, OutOfMemory, Overloaded
from vae_service.engine.plan import TileSpreader
from vae_service.engine.result import PendingResult
from vae_service.serving.batcher import BatcherLimits, BatchStats, DeadlineExceeded, KeyedBatcher, QueueFull
from vae_service.serving.encoders import EncoderPool
from vae_service.serving.frame_stream import FrameStream

# Inputs above this size are parsed and checked off the event loop, where they cannot stall other
# requests. Measured here: a thread hop ~0.07 ms; parsing and checking a 64 KiB body inline
# ~0.07 ms, so up to 256 KiB the hop would cost as much as it saves.
INLINE_BYTES = 256 * 1024


def batcher_limits(live: LiveConfig) -> BatcherLimits:
    b = live.batching
    return BatcherLimits(
        max_batch_size=b.max_batch_size, batch_wait_ms=b.batch_wait_ms, max_queued_items=b.max_queued_items
    )


class DecodeService:
    def __init__(
        self,
        config: ServiceConfig,
        engine: DecodeEngine | None = None,
        on_batch: Callable[[BatchStats], None] | None = None,
        on_rejected: Callable[[BaseException], None] | None = None,
        on_decoded: Callable[[DecodeResult], None] | None = None,
        on_first_frames: Callable[[str, float], None] | None = None,
        spread: TileSpreader | None = None,
    ):
        self.config = config
        self.engine = engine or DecodeEngine(config)
        self.spread = spread  # tiled `high` images: tiles decoded by other replicas (tile_spread.py)
        # one thread feeds the device, set up once like the engine wants (torch's CPU thread count)
        self.device_thread = ThreadPoolExecutor(1, thread_name_prefix="vae-device", initializer=self.engine.bind_thread)
        self.batcher: KeyedBatcher[PreparedRequest] = KeyedBatcher(
            self._decode_batch, batcher_limits(config.live()), self._observe, executor=self.device_thread
        )
        self.encoders = EncoderPool(self.engine.encode_settings, config.encoding.threads)
        self.on_batch, self.on_rejected = on_batch, on_rejected
        self.on_decoded, self.on_first_frames = on_decoded, on_first_frames  # (quality, ms)
        self.decoded_items = 0  # latent items that reached the device (requests given up on never do)

    def _decode_batch(self, batch: list[PreparedRequest], abandoned) -> list:
        # the device thread takes its next batch while this one's output is still copied to the
        # host (CUDA); the wait happens in _decode_prepared, off the device thread
        return self.engine.decode(batch, abandoned, defer_host_copy=True, spread=self.spread)

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
        """Limits and batching, in place; every other setting is fixed for the replica's life."""
        self.config = self.config.with_live(live)
        self.engine.limits = live.limits
        self.batcher.update(batcher_limits(live))

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        return await self.decode_from(lambda: request, request.latents.nbytes)

    async def decode_from(self, parse: Callable[[], DecodeRequest], size: int) -> DecodeResult:
        """Parse and check a request (off the event loop when `size` bytes are many), then queue it
        for its batch. Raises the engine's DecodeError kinds."""
        prepared = await self._prepare(parse, size)
        if prepared.request.stream:
            raise InvalidInput("stream", "this call answers whole outputs; stream frames with the streaming call")
        return await self._decode_prepared(prepared)

    async def submit(self, parse: Callable[[], DecodeRequest], size: int) -> DecodeResult | FrameStream:
        """Like decode_from, but a request with `stream` set comes back as a FrameStream once its
        first frames are decoded (errors before them are raised here)."""
        arrived = time.perf_counter()
        prepared = await self._prepare(parse, size)
        if not prepared.request.stream:
            return await self._decode_prepared(prepared)
        stream = FrameStream(prepared.items)
        await stream.start(asyncio.ensure_future(self._decode_prepared(replace(prepared, sink=stream.sink))))
        if self.on_first_frames is not None:
            self.on_first_frames(prepared.request.quality, (time.perf_counter() - arrived) * 1e3)
        return stream

    async def _prepare(self, parse: Callable[[], DecodeRequest], size: int) -> PreparedRequest:
        def prepare() -> PreparedRequest:
            return self.engine.prepare(parse())

        # a tier priced per shape (CPU Winograd) may run its meta twin for a new shape: off the loop
        inline = size <= INLINE_BYTES and self.engine.prices_in_constant_time
        return prepare() if inline else await asyncio.to_thread(prepare)

    async def _decode_prepared(self, prepared: PreparedRequest) -> DecodeResult:
        arrived = time.perf_counter()
        try:
            result = await self.batcher.submit(prepared, timeout_s=self.config.batching.request_timeout_s)
        except QueueFull as exc:
            raise Overloaded("body", f"decode queue is full ({exc}); retry later", exc.retry_after_s) from None
        except DeadlineExceeded as exc:
            raise DecodeTimeout("body", f"not decoded within request_timeout_s: {exc}") from None
        except torch.OutOfMemoryError:
            raise OutOfMemory(
                "latents",
                "the device ran out of memory for this request; retry later or send fewer items",
                self.config.serving.retry_after_s,
            ) from None
        if isinstance(result, PendingResult):
            result = await asyncio.to_thread(result.wait)
        if self.on_decoded is not None:
            self.on_decoded(result)
        decoded_ms = (time.perf_counter() - arrived) * 1e3
        result = replace(result, timing=replace(result.timing, queue_ms=max(0.0, decoded_ms - result.timing.decode_ms)))
        return await self.encoders.finish(result)

    def describe(self) -> dict:
        return {
            **self.engine.describe(),
            "batching": self.config.batching.model_dump(),
            "queued_items": self.batcher.queued_items(),
            "running_batches": self.batcher.running,
            "decoded_items": self.decoded_items,
        }

    def release_folded(self) -> int:
        return self.engine.release_folded()

    async def drain(self, timeout_s: float) -> bool:
        """Let queued and running batches finish (shutdown); False if they did not in time."""
        drained = await self.batcher.drain(timeout_s)
        self.device_thread.shutdown(wait=False)
        self.encoders.shutdown()
        return drained
