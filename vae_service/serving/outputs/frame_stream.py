"""One streamed request inside a replica: the engine hands each chunk of frames over from the
device thread; the wire layers read them here, in order, then the request's result.

A decode that is retried (a failed batch runs again item by item; a `high` decode out of device
memory runs again in tiles) hands its chunks over again from the start: only frames not yet
passed on go out, so a client never sees a frame twice, and the result says where the retry's
frames begin (`retried_from_frame`: every item's frames before it are the first attempt's; the
retry's can differ from those in their last bits, or as much as tiling changes them). Leaving the stream early (a
client that went away) cancels the request; a decode whose requests are all gone stops at its
next chunk.

An item whose fp16/bf16 decode overflowed is decoded again in fp32 (engine/execution/video.py): its
frames already sent were finite and stay the answer; the fp32 decode's frames pass on from the
first frame not sent. The result then says what decoded the frames sent: `fallback_from_frame`,
per item in `fallback`, the first frame that came from fp32 (0: all of them), and `precision` is
"fp32" only where every frame sent was.

The stream holds at most `CHUNKS_AHEAD` chunks its reader has not taken: the decode waits to hand
over more (in slices that check the request), off the device (other decodes run their steps
meanwhile), so a slow reader slows its decode instead of piling a clip up here or holding the
device. Those chunks and the one its reader holds are in the streamed request's
price (engine/pricing/cost_model.py's `streamed_bytes`: on a CPU they are in the decode's memory);
nothing here keeps a chunk once it is passed on (the first one included). (Serve passes what the
replica sends on to the proxy without backpressure: what a slow HTTP client has not read waits
there.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

from vae_service.engine.execution.call import wait_off_device
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.pricing.cost_model import STREAM_CHUNKS_AHEAD
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.result import DecodeResult

CHUNKS_AHEAD = STREAM_CHUNKS_AHEAD  # chunks handed over and not yet taken by the stream's reader (priced)


class FrameStream:
    def __init__(self, items: int, context: RequestContext) -> None:
        self._loop, self._context = asyncio.get_running_loop(), context
        self._queue: asyncio.Queue[FrameChunk] = asyncio.Queue()
        self._room = threading.Semaphore(CHUNKS_AHEAD)
        self._sent = [0] * items  # per item: frames passed on
        self._retried_from: int | None = None
        self._fp32_from: dict[int, int] = {}  # item -> the first frame passed on from its fp32 fallback
        self._precision: str | None = None  # what decoded the other frames passed on, where chunks say
        self._task: asyncio.Future | None = None
        self._events: AsyncIterator | None = None
        self._first = None

    def sink(self, chunk: FrameChunk) -> None:
        """Called on the decode's device thread between two of its steps: waits while CHUNKS_AHEAD
        chunks are not taken yet, the device given to other decodes meanwhile."""
        if not self._room.acquire(blocking=False):
            wait_off_device(self._wait_for_room)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    def _wait_for_room(self) -> None:
        self._context.wait_until(lambda s: self._room.acquire(timeout=s), "a stream's reader taking its frames")

    def _take(self, chunk: FrameChunk) -> FrameChunk | None:
        self._room.release()
        return self._fresh(chunk)

    async def start(self, decode: asyncio.Future) -> None:
        """Wait for the first frames; an error before them (queue full, timeout, bad latents) is
        raised here, where the caller can still answer with an ordinary error status."""
        self._task = decode
        self._events = self._iterate()
        try:
            self._first = await anext(self._events)
        except BaseException:
            await self._events.aclose()
            raise

    @property
    def first_chunk(self) -> FrameChunk:
        """The first frames (after `start`), still to come out of `events`."""
        return self._first

    async def close(self) -> None:
        """Leave without reading `events` (cancels the decode)."""
        await self._events.aclose()

    async def events(self) -> AsyncIterator[FrameChunk | DecodeResult]:
        """FrameChunks, then the DecodeResult (output None); a failure mid-stream raises."""
        try:
            first, self._first = self._first, None  # passed on: its reader holds it, not the stream
            yield first
            async for event in self._events:
                yield event
        finally:
            await self._events.aclose()

    def _fresh(self, chunk: FrameChunk) -> FrameChunk | None:
        """The part of `chunk` not passed on yet (None: all of it was). A decode hands an item's
        frames over in order, so a chunk starting before what was passed on is a retry's, and so is
        an fp32 fallback's for an item that had sent frames."""
        items = range(chunk.item, chunk.item + chunk.pixels.shape[0])
        sent, end = self._sent[chunk.item], chunk.frame + chunk.frames
        fp32_after_sent = chunk.fallback and sent > 0 and chunk.item not in self._fp32_from
        if (chunk.frame < sent or fp32_after_sent) and self._retried_from is None:
            self._retried_from = min(self._sent)
        if end <= sent:
            return None
        if chunk.frame < sent:
            pixels = chunk.pixels.narrow(chunk.frame_axis, sent - chunk.frame, end - sent)
            chunk = replace(chunk, frame=sent, pixels=pixels)
        for item in items:
            if chunk.fallback:
                self._fp32_from.setdefault(item, chunk.frame)
            self._sent[item] = end
        if not chunk.fallback and chunk.precision is not None:
            self._precision = chunk.precision
        return chunk

    def _answered(self, result: DecodeResult) -> DecodeResult:
        """The result as the frames passed on say it: where each item in `fallback` begins to be
        fp32, and `precision` fp32 only where every frame sent was (the engine names the whole
        answer's, in which a fallen-back item is fp32 from its first frame)."""
        retried = replace(result, retried_from_frame=self._retried_from)
        if not result.fallback:
            return retried
        from_frame = tuple(self._fp32_from.get(i, self._sent[i]) for i in result.fallback)
        all_fp32 = len(result.fallback) == len(self._sent) and not any(from_frame)
        precision = result.precision if all_fp32 or self._precision is None else self._precision
        return replace(retried, fallback_from_frame=from_frame, precision=precision)

    async def _iterate(self) -> AsyncIterator[FrameChunk | DecodeResult]:
        try:
            while True:
                getter = asyncio.ensure_future(self._queue.get())
                try:
                    await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    chunk = self._take(getter.result())
                    if chunk is not None:
                        yield chunk
                    continue
                while not self._queue.empty():  # handed over before the result arrived
                    chunk = self._take(self._queue.get_nowait())
                    if chunk is not None:
                        yield chunk
                yield self._answered(self._task.result())
                return
        finally:
            if not self._task.done():
                self._task.cancel()
