"""Video decode chunk by chunk (one latent frame per decoder call, as diffusers does): each chunk's
frames are checked, converted to the request's output and either handed to the request's sink
at once (streaming) or kept for its whole answer. A streamed request keeps nothing.

Every chunk is checked finite before it is handed over, so a stream never sends frames it will
take back. An item whose frames are not finite (fp16/bf16 overflow) stops there; with the fp32
fallback on (engine/execution/fallback.py) it is decoded again in fp32 from its first frame (the
causal cache needs them all) once its run ends. A whole answer is overwritten with all of it (a
`float` one becomes fp32); a stream is handed only the fp32 frames from the first one this answer
had not handed over, marked `fallback` (serving/outputs/frame_stream.py passes on those not sent yet and
says in `done` from which frame each item's frames are fp32: the frames sent stay the answer)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import closing
from dataclasses import dataclass

import torch

from vae_service.engine.execution.call import DecodeCall, checked_chunks
from vae_service.engine.execution.fallback import FALLBACK_PRECISION, Fp32Fallback
from vae_service.engine.media.postprocess import convert, to_host
from vae_service.engine.request.errors import DecodeFailed
from vae_service.engine.request.latents import PreparedRequest
from vae_service.models.catalog import PixelRange

NON_FINITE = (
    "the decoder produced NaN/Inf for these latents (overflow at this precision?); "
    "try fp32 or check the latents' scaling"
)


@dataclass(frozen=True)
class FrameChunk:
    """Frames `frame`.. of batch items `item`..: uint8 [n, t, H, W, 3] or float [n, 3, t, H, W]."""

    item: int
    frame: int
    pixels: torch.Tensor
    precision: str | None = None  # what decoded them, where an fp32 fallback may answer (else None)
    fallback: bool = False  # decoded again in fp32: their item's first decode overflowed

    @property
    def frame_axis(self) -> int:
        return 1 if self.pixels.dtype == torch.uint8 else 2

    @property
    def frames(self) -> int:
        return self.pixels.shape[self.frame_axis]


class IncompleteOutput(RuntimeError):
    """The decoder handed over other frames than the model's traced geometry promised: a server
    bug, answered as an internal error. Never answered with the output, whose unwritten frames
    would be whatever the allocator left there (another request's pixels, on a busy replica)."""


FrameSink = Callable[[FrameChunk], None]
ChunkDecoder = Callable[[torch.Tensor], Iterator[torch.Tensor]]  # [n, C, T, h, w] -> [n, 3, t, H, W] per chunk


class _Answer:
    """One request's frames as they come: streamed to its sink (on the host at once) or written
    into its whole output on the device, copied to the host once at the end."""

    def __init__(
        self, prepared: PreparedRequest, pending: list | None, pixels: PixelRange, fallback: Fp32Fallback | None
    ):
        self.prepared, self.pending, self.pixels = prepared, pending, pixels
        self.output, self.sink = prepared.request.output, prepared.sink
        self.fallback = fallback
        # what decoded the first attempt's frames, said on each chunk where a fallback may follow
        self.precision = None if fallback is None else fallback.runtime.precision
        self.whole: torch.Tensor | None = None
        self.failed: DecodeFailed | None = None
        self.written = [0] * prepared.items  # frames handed over per item, in order
        self.overflowed: list[int] = []  # items whose output was not finite: decoded again in fp32
        self.handed_before: dict[int, int] = {}  # overflowed item -> its frames handed over (all finite)

    def _account(self, item: int, frame: int, count: int, frames: int) -> None:
        for i in range(item, item + count):
            if i >= len(self.written) or self.written[i] != frame or frame + frames > self.prepared.frames:
                raise IncompleteOutput(
                    f"decoder handed over frames {frame}..{frame + frames - 1} of item {i}; expected frame "
                    f"{self.written[i] if i < len(self.written) else '-'} of {self.prepared.frames}"
                )
            self.written[i] = frame + frames

    def stopped(self, item: int, count: int) -> bool:
        """Whether items item..item+count-1 need no more frames of this run."""
        return self.failed is not None or all(i in self.overflowed for i in range(item, item + count))

    def add(self, item: int, frame: int, decoded: torch.Tensor) -> None:
        if self.failed is not None:
            return
        if bool(torch.isfinite(decoded).all()) and not self.overflowed:
            self._account(item, frame, decoded.shape[0], decoded.shape[2])
            self._hand_over(item, frame, decoded)
            return
        for row in range(decoded.shape[0]):  # row by row: only some items may have overflowed
            if item + row in self.overflowed:
                continue
            self._account(item + row, frame, 1, decoded.shape[2])
            if bool(torch.isfinite(decoded[row]).all()):
                self._hand_over(item + row, frame, decoded[row : row + 1])
            elif self.fallback is not None:
                self.overflowed.append(item + row)
                self.handed_before[item + row] = frame
            else:
                self.failed = DecodeFailed("latents", NON_FINITE)
                return

    def _hand_over(self, item: int, frame: int, decoded: torch.Tensor, fallback: bool = False) -> None:
        chunk = FrameChunk(item, frame, convert(decoded, self.output, self.pixels))
        if self.sink is not None:
            precision = FALLBACK_PRECISION if fallback else self.precision
            self.sink(FrameChunk(item, frame, to_host(chunk.pixels), precision, fallback))
            return
        if self.whole is None:  # sized from the first chunk: every item's frames, no joining later
            shape = list(chunk.pixels.shape)
            shape[0], shape[chunk.frame_axis] = self.prepared.items, self.prepared.frames
            self.whole = chunk.pixels.new_empty(shape)
        if self.whole.dtype != chunk.pixels.dtype:  # an fp32 item in a float answer: all of it fp32
            self.whole = self.whole.float()
        rows = self.whole[item : item + chunk.pixels.shape[0]]
        rows.narrow(chunk.frame_axis, frame, chunk.frames).copy_(chunk.pixels.to(self.whole.dtype))

    def fall_back(self, tiled: bool) -> None:
        """Every overflowed item decoded again in fp32 from its first frame. A whole answer takes
        all of its frames; a stream only those from the first frame not handed over yet (the
        frames before went out, finite: they stay the answer, and `done` says where fp32 begins)."""
        if self.failed is not None or not self.overflowed:
            return
        z = self.fallback.latents(self.prepared)
        for item in self.overflowed:
            sent = self.handed_before[item] if self.sink is not None else 0
            self.written[item], frame = 0, 0
            for decoded in self.fallback.chunks(z[item : item + 1], self.prepared.timestep, tiled):
                self._account(item, frame, 1, decoded.shape[2])
                if not bool(torch.isfinite(decoded).all()):  # not even fp32 decodes these latents
                    self.failed = DecodeFailed("latents", NON_FINITE)
                    return
                end = frame + decoded.shape[2]
                if end > sent:  # frames before `sent` only fed the causal cache
                    start = max(frame, sent)
                    self._hand_over(item, start, decoded[:, :, start - frame :], fallback=True)
                frame = end
        self.fallback.items += len(self.overflowed)

    def result(self) -> torch.Tensor | DecodeFailed | None:
        """The whole output; None when it was streamed."""
        if self.failed is not None:
            return self.failed
        if any(n != self.prepared.frames for n in self.written):
            raise IncompleteOutput(f"decoder wrote {self.written} frames per item, expected {self.prepared.frames}")
        return None if self.sink is not None else to_host(self.whole, self.pending)


@dataclass(frozen=True)
class _Rows:
    """Rows lo..hi of a decoder run's output are items `item`.. of `answer`'s request."""

    answer: _Answer
    item: int
    lo: int
    hi: int


def decode_video(
    batch: list[PreparedRequest],
    latents: list[torch.Tensor],
    together: bool,
    chunks: ChunkDecoder,
    call: DecodeCall,
    members: list[int],
    fallback: Fp32Fallback | None,
    pixels: PixelRange = "signed",
    fallback_tiled: Collection[int] = frozenset(),
) -> list[torch.Tensor | DecodeFailed | None]:
    """One run of a batch plan: `latents`, its requests' decoder inputs (`members`: their indices
    in the call). `together`: their items share one decoder run (high); otherwise every item runs
    alone (lossless). The call's checkpoint runs before each chunk; its host copies: see
    postprocess.to_host. `pixels`: the decoder's range. Items that overflowed fall back here (None: no
    fallback, they fail), by the class's own tiled decode for the members in `fallback_tiled` (their
    fp32 plan), else whole."""
    answers = [_Answer(r, call.host_copies, pixels, fallback) for r in batch]
    if together:
        rows, start = [], 0
        for answer, z in zip(answers, latents, strict=True):
            rows.append(_Rows(answer, 0, start, start + z.shape[0]))
            start += z.shape[0]
        runs = [(torch.cat(latents), rows)]
    else:
        runs = [
            (item, [_Rows(answer, i, 0, 1)])
            for answer, z in zip(answers, latents, strict=True)
            for i, item in enumerate(z.split(1))
        ]
    for z, members_of_run in runs:
        frame = 0
        with closing(checked_chunks(chunks(z), call.checkpoint)) as outputs:
            for out in outputs:
                for m in members_of_run:
                    m.answer.add(m.item, frame, out[m.lo : m.hi])
                frame += out.shape[2]
                if all(m.answer.stopped(m.item, m.hi - m.lo) for m in members_of_run):
                    break  # every item of this run overflowed (or failed): nothing more to decode
    for answer, i in zip(answers, members, strict=True):
        answer.fall_back(tiled=i in fallback_tiled)
        if answer.overflowed and answer.failed is None:
            call.fell_back[i] = sorted(answer.overflowed)
    return [a.result() for a in answers]
