"""The framework-free core of a decode replica: validation, serialised device work off the event
loop, timing, response building. The Serve deployment and the tests both drive this class."""

from __future__ import annotations

import asyncio
import time

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine
from vae_service.protocol.decode_schema import DecodeParams, response_map


def needs_new_engine(old: ServiceConfig, new: ServiceConfig) -> bool:
    """Limits change live; anything that changes the weights or their placement reloads."""
    return old.model_copy(update={"limits": new.limits}) != new


class DecodeService:
    def __init__(self, config: ServiceConfig, engine: DecodeEngine | None = None):
        self.config = config
        self.engine = engine or DecodeEngine(config)
        self._device_lock = asyncio.Lock()  # one decode on the device at a time

    def reconfigure(self, config: ServiceConfig) -> None:
        """Limits apply in place; a new model, precision or device re-materialises the weights and
        drops the old engine's folded buffers (an in-flight decode keeps its own references)."""
        if needs_new_engine(self.config, config):
            self.engine.release_folded()
            self.engine = DecodeEngine(config)
        else:
            self.engine.config = config
        self.config = config

    def release_folded(self) -> int:
        return self.engine.release_folded()

    async def decode(self, params: DecodeParams) -> dict:
        arrived = time.perf_counter()
        prepared = await asyncio.to_thread(self.engine.prepare, params)
        async with self._device_lock:
            started = time.perf_counter()
            (result,) = await asyncio.to_thread(self.engine.decode, [prepared])
        timing = {
            "queue_ms": round((started - arrived) * 1e3, 3),
            "decode_ms": round(result.decode_ms, 3),
            "batch_size": result.batch_size,
        }
        return response_map(
            result.output,
            model=self.engine.spec.name,
            quality=prepared.quality,
            precision=self.engine.precision,
            request_id=prepared.request_id,
            timing=timing,
        )
