"""The framework-free core of a decode replica: validation, tier-keyed batching with serialised
device work off the event loop, timing, error mapping, response building. The Serve deployment
and the tests both drive this class."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import torch

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeResult, PreparedRequest
from vae_service.errors import DecodeTimeout, Overloaded
from vae_service.protocol.decode_schema import DecodeParams, response_map
from vae_service.serving.batcher import BatcherLimits, BatchStats, DeadlineExceeded, KeyedBatcher, QueueFull

_LIVE_FIELDS = {"limits", "batching", "serving"}


@dataclass
class DecodeOutcome:
    output: torch.Tensor | list[bytes]
    model: str
    quality: str
    precision: str
    request_id: str | None
    timing: dict

    def wire(self) -> dict:
        """The /decode response map (tensor outputs as tensor maps)."""
        return response_map(self.output, model=self.model, quality=self.quality, precision=self.precision,
                            request_id=self.request_id, timing=self.timing)


def needs_new_engine(old: ServiceConfig, new: ServiceConfig) -> bool:
    """Limits and batching change live; anything that changes the weights or their placement reloads."""
    return old.model_copy(update={f: getattr(new, f) for f in _LIVE_FIELDS}) != new


def batcher_limits(config: ServiceConfig) -> BatcherLimits:
    b = config.batching
    return BatcherLimits(max_batch_size=b.max_batch_size, batch_wait_ms=b.batch_wait_ms,
                         max_queued_items=b.max_queued_items)


class DecodeService:
    def __init__(self, config: ServiceConfig, engine: DecodeEngine | None = None,
                 on_batch: Callable[[BatchStats], None] | None = None):
        self.config = config
        self.engine = engine or DecodeEngine(config)
        self.batcher: KeyedBatcher[PreparedRequest] = KeyedBatcher(self._run_batch, batcher_limits(config), on_batch)

    def _run_batch(self, batch: list[PreparedRequest]) -> list[DecodeResult | Exception]:
        return self.engine.decode(batch)  # the engine current when the batch runs

    def reconfigure(self, config: ServiceConfig) -> None:
        """Limits and batching apply in place; a new model, precision or device re-materialises
        the weights and drops the old engine's folded buffers (in-flight work keeps its refs)."""
        if needs_new_engine(self.config, config):
            self.engine.release_folded()
            self.engine = DecodeEngine(config)
        else:
            self.engine.config = config
        self.batcher.update(batcher_limits(config))
        self.config = config

    def release_folded(self) -> int:
        return self.engine.release_folded()

    async def decode(self, params: DecodeParams) -> DecodeOutcome:
        arrived = time.perf_counter()
        prepared = await asyncio.to_thread(self.engine.prepare, params)
        result = await self.submit(prepared)
        total_ms = (time.perf_counter() - arrived) * 1e3
        timing = {
            "queue_ms": round(max(0.0, total_ms - result.decode_ms), 3),
            "decode_ms": round(result.decode_ms, 3),
            "batch_size": result.batch_size,
        }
        return DecodeOutcome(result.output, self.engine.spec.name, prepared.quality, self.engine.precision,
                             prepared.request_id, timing)

    async def submit(self, prepared: PreparedRequest) -> DecodeResult:
        try:
            return await self.batcher.submit(prepared, timeout_s=self.config.batching.request_timeout_s)
        except QueueFull as exc:
            raise Overloaded("body", f"decode queue is full ({exc}); retry later", exc.retry_after_s) from None
        except DeadlineExceeded as exc:
            raise DecodeTimeout("body", f"not decoded within request_timeout_s: {exc}") from None
