"""One streamed request inside a replica: the engine hands each chunk of frames over from the
device thread; the wire layers read them here, in order, then the request's result.

A decode that is retried (a failed batch runs again item by item; a `high` decode out of device
memory runs again in tiles) hands its chunks over again from the start: only frames not yet
passed on go out, so a client never sees a frame twice. Leaving the stream early (a client that
went away) cancels the request; a decode whose requests are all gone stops at its next chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from vae_service.engine.result import DecodeResult
from vae_service.engine.video import FrameChunk


class FrameStream:
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[FrameChunk] = asyncio.Queue()
        self._sent: dict[int, int] = {}  # per first item: frames passed on
        self._task: asyncio.Future | None = None
        self._events: AsyncIterator | None = None
        self._first = None

    def sink(self, chunk: FrameChunk) -> None:
        """Called on the device thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

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

    async def events(self) -> AsyncIterator[FrameChunk | DecodeResult]:
        """FrameChunks, then the DecodeResult (output None); a failure mid-stream raises."""
        try:
            yield self._first
            async for event in self._events:
                yield event
        finally:
            await self._events.aclose()

    def _fresh(self, chunk: FrameChunk) -> FrameChunk | None:
        sent, end = self._sent.get(chunk.item, 0), chunk.frame + chunk.frames
        if end <= sent:
            return None
        if chunk.frame < sent:
            pixels = chunk.pixels.narrow(chunk.frame_axis, sent - chunk.frame, end - sent)
            chunk = FrameChunk(chunk.item, sent, pixels)
        self._sent[chunk.item] = end
        return chunk

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
                    chunk = self._fresh(getter.result())
                    if chunk is not None:
                        yield chunk
                    continue
                while not self._queue.empty():  # handed over before the result arrived
                    chunk = self._fresh(self._queue.get_nowait())
                    if chunk is not None:
                        yield chunk
                yield self._task.result()
                return
        finally:
            if not self._task.done():
                self._task.cancel()
