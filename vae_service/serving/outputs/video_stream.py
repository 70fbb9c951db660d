"""A streamed video answer (`mp4` or `webm`) inside a replica: the request's frames, as its
FrameStream hands them over, cut into the answer's fragments (engine/media/encoding.py's
`fragment_frames`: one latent frame's worth each; a WebM fragment is a Cluster) and each encoded in
the encoder pool as soon as its frames are in: off the device thread and the event loop, so a slow
encode never stalls the device.

Nothing piles up: a fragment is encoded before the next chunk is taken, and the FrameStream holds
at most CHUNKS_AHEAD chunks its reader has not taken (the device thread waits for room), so a slow
encoder slows its own decode instead of buffering the clip. The encoder and the decode overlap:
the device decodes the next latent frames while a fragment encodes.

The bytes are those of the whole `mp4` (`webm`) answer of the same frames: init segment, fragments, in
order (a retried decode's frames pass on from where the first attempt stopped, as for raw frames).
So is an item that fell back to fp32 after fragments went out: the fragments sent stay, the fp32
frames fill the fragments from the first frame not sent (always a fragment's first: the first
decode stops at a latent frame), and the summary says so (`fallback_from_frame`, `precision`), as
the FrameStream's result does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np

from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.media.encoding import video_writer
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeTimeout
from vae_service.engine.request.result import DecodeResult
from vae_service.serving.outputs.encoders import EncoderPool, failed_encode
from vae_service.serving.outputs.frame_stream import FrameStream
from vae_service_client.mp4 import MP4_MEDIA_TYPE, Mp4Fragment
from vae_service_client.webm import WEBM_MEDIA_TYPE

MEDIA_TYPES = {"mp4": MP4_MEDIA_TYPE, "webm": WEBM_MEDIA_TYPE}


class VideoStream:
    """`output`: mp4 or webm. Its events are Mp4Fragments (a fragment of either container: the name is
    the wire's, vae_service_client.mp4), then the DecodeResult."""

    def __init__(
        self,
        frames: FrameStream,
        pool: EncoderPool,
        output: str,
        fragments: tuple[int, ...],
        context: RequestContext,
    ):
        if output not in MEDIA_TYPES:
            raise ValueError(f"{output!r} is not a streamed video output ({', '.join(MEDIA_TYPES)})")
        self._frames, self._pool, self._context = frames, pool, context
        self.output = output
        self._fragments = list(fragments)
        self._pending: list[np.ndarray] = []  # frames [t, H, W, 3] of the fragment being gathered
        self._gathered = 0
        self._frame = 0  # the first frame of that fragment
        self._writer = None
        self._init: bytes | None = None
        self._encode_s = 0.0
        self.codecs = ""  # RFC 6381, known once the first frames opened the encoder (`start`)

    @property
    def media_type(self) -> str:
        """The answer's Content-Type, codecs included (known after `start`)."""
        return f'{MEDIA_TYPES[self.output]}; codecs="{self.codecs}"'

    async def start(self, decode: asyncio.Future) -> None:
        """Wait for the first frames and open the encoder with them: errors before either are
        raised here, where the caller can still answer with an ordinary error status."""
        await self._frames.start(decode)
        first = self._frames.first_chunk.pixels
        height, width = first.shape[-3:-1]
        try:
            self._writer = await self._encode(video_writer, self.output, int(width), int(height), self._pool.settings)
            self._init = self._writer.init_segment()
        except BaseException:
            await self._frames.close()
            raise
        self.codecs = self._writer.codecs

    async def events(self) -> AsyncIterator[Mp4Fragment | DecodeResult]:
        """Mp4Fragments as their frames are in, then the DecodeResult (output None)."""
        try:
            async for event in self._frames.events():
                if isinstance(event, FrameChunk):
                    async for fragment in self._take(event.pixels[0].numpy()):
                        yield fragment
                    continue
                if self._fragments:  # fewer frames than planned: a decoder bug, never a short video
                    short = sum(self._fragments) - self._gathered
                    raise RuntimeError(f"the stream ended {short} frames short of its fragments")
                timing = replace(event.timing, encode_ms=self._encode_s * 1e3)
                yield replace(event, timing=timing)
        finally:
            if self._writer is not None:
                self._writer.close()

    async def _take(self, frames: np.ndarray) -> AsyncIterator[Mp4Fragment]:
        """Frames [t, H, W, 3] in order -> the fragments they complete, each as soon as it is
        encoded (a decoder that hands a whole clip over at once still streams fragment by fragment)."""
        start = 0
        while start < len(frames):
            if not self._fragments:
                raise RuntimeError("the stream handed over more frames than its fragments hold")
            take = min(self._fragments[0] - self._gathered, len(frames) - start)
            self._pending.append(frames[start : start + take])
            self._gathered += take
            start += take
            if self._gathered == self._fragments[0]:
                yield await self._encode_pending()

    async def _encode_pending(self) -> Mp4Fragment:
        frames = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        data = await self._encode(self._writer.fragment, frames)
        if self._init is not None:
            data, self._init = self._init + data, None
        fragment = Mp4Fragment(self._frame, len(frames), data)
        self._frame += len(frames)
        self._pending, self._gathered = [], 0
        self._fragments.pop(0)
        return fragment

    async def _encode(self, work, *args):
        loop, start = asyncio.get_running_loop(), time.perf_counter()
        future = loop.run_in_executor(self._pool.executor, work, *args)
        try:
            return await asyncio.wait_for(future, self._context.remaining())
        except TimeoutError:
            raise DecodeTimeout("output", "not encoded within request_timeout_s") from None
        except Exception as exc:
            raise failed_encode(self.output, exc) from None
        finally:
            self._encode_s += time.perf_counter() - start
