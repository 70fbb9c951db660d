"""Encoding (png, jpeg, webp, avif; mp4, webm) off the device thread: the device hands decoded uint8 pixels over and
takes its next batch while a bounded pool encodes; the items of one request encode in parallel;
a failed encode fails its own request only (nothing is decoded again)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from vae_service.engine.media.encoding import EncodeSettings, encode_item, items
from vae_service.engine.request.errors import EncodeFailed
from vae_service.engine.request.result import DecodeResult

log = logging.getLogger("ray.serve")


class EncoderPool:
    def __init__(self, settings: EncodeSettings, threads: int):
        self.settings = settings
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="vae-encode")
        self.encode_item = encode_item  # one file from one item's pixels (a seam for fault tests)

    async def finish(self, result: DecodeResult) -> DecodeResult:
        if result.encode_as is None:
            return result
        loop, fmt, start = asyncio.get_running_loop(), result.encode_as, time.perf_counter()
        work = [
            loop.run_in_executor(self.executor, self.encode_item, item, fmt, self.settings, result.fragments)
            for item in items(result.output.numpy(), fmt)
        ]
        try:
            files = await asyncio.gather(*work)
        except Exception as exc:
            raise failed_encode(fmt, exc) from None
        timing = replace(result.timing, encode_ms=(time.perf_counter() - start) * 1e3)
        return replace(result, output=list(files), encode_as=None, timing=timing)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)


def failed_encode(fmt: str, exc: BaseException) -> EncodeFailed:
    """What a failed encode answers (its own request only); the cause goes to the server log."""
    error_id = uuid.uuid4().hex[:12]
    log.error("encoding %s failed, error id %s", fmt, error_id, exc_info=exc)
    return EncodeFailed(
        "output", f"encoding the decoded pixels as {fmt} failed (error id {error_id}, see the server log)"
    )
