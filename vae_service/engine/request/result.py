"""What the engine answers: the output and the facts of the decode that produced it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

COPY_POLL_S = 0.0005  # a pinned copy of a 1024 px image takes ~0.1 ms on an H200's link


@dataclass(frozen=True)
class Timing:
    queue_ms: float  # arrival to the start of its batch's decode (filled in by whoever queued it)
    decode_ms: float  # the engine call that decoded it, uint8 conversion included
    batch_size: int  # latent items decoded in that call
    encode_ms: float = 0.0  # PNG/JPEG/MP4 encoding of its items, after the decode
    replicas: int = 1  # replicas whose decoders worked on it (this one and those that took its tiles)
    preempted_ms: float = 0.0  # its decode suspended between steps while more urgent work ran


@dataclass(frozen=True)
class DecodeResult:
    # uint8 [B,(T,)H,W,3] or float [B,3,(T,)H,W] on the CPU; or files; None once streamed
    output: torch.Tensor | list[bytes] | None
    model: str  # the model and precision that decoded it (fp32 where every item, every frame sent, fell back)
    precision: str
    quality: str
    request_id: str | None
    timing: Timing
    encode_as: str | None = None  # png | jpeg | mp4 while `output` still holds the pixels to encode
    tiled: bool = False  # decoded in overlapping spatial tiles to stay within limits.max_decode_bytes
    retried_from_frame: int | None = None  # streams: every item's frames before it: the first attempt's
    fragments: tuple[int, ...] = ()  # mp4, webm: frames per fragment (engine/media/encoding.py's fragment_frames)
    fallback: tuple[int, ...] = ()  # items decoded again in fp32: their output overflowed `precision` (fallback.py)
    # streams: per item in `fallback`, the first of its frames sent from the fp32 decode (those before it
    # went out from the first decode, finite); None for a whole answer, whose fallen-back items are all fp32
    fallback_from_frame: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PendingResult:
    """A decode whose output is still being copied to the host (CUDA, `defer_host_copy`): the
    result once `wait()` returns. The device thread meanwhile queues the next batch."""

    result: DecodeResult
    host_copies: tuple  # CUDA events recorded after the copies

    def wait(self) -> DecodeResult:
        for event in self.host_copies:
            event.synchronize()
        return self.result

    def copied(self, within_s: float) -> bool:
        """Whether the copies are done, looking for at most `within_s` (a wait in slices: the caller
        checks its request between them)."""
        end = time.monotonic() + within_s
        while not all(event.query() for event in self.host_copies):
            if time.monotonic() >= end:
                return False
            time.sleep(COPY_POLL_S)
        return True
