"""Peak decode memory per tier, model and shape, without decoding anything: the tier's own graph
(for `high`, the fast path installed on the twin with the rewrites the real device runs) runs on
the meta device (shapes only, no data, no compute) while a dispatch mode counts the bytes of live
tensor storage. For the same graph it counts what a real CPU decode holds to within 0.1%
(measured on the 64-channel test decoder); a request's estimate adds the answer's conversion
(engine/pricing/cost_model.py) and is tested within 10% of a real decode's peak.

- `working`: the peak while decoding one request's items (one latent frame at a time for the
  causal walk, its causal history included; per latent frame for video decoders that take a clip
  at once);
- `resident`: what a video decode holds between chunks (the causal history), which every tile of
  a tiled decode keeps at once.

Two kinds of tier, decided at start-up by three probes:
- `AffineTier`: bytes affine in latent pixels (both tiers of SD, FLUX, Wan2.1 and the tiny
  presets; the folded weights `high` builds once are held, priced apart): two numbers per line,
  every shape priced by formula, in constant time;
- `PerShapeTier`: not affine. CPU fp32 `high` of a wide image decoder: Winograd works in
  cache-sized chunks, so its scratch stops growing past a few hundred pixels per side (SD at 1024 px
  holds 35% of what a rate from 128 px predicts). Priced per shape on the twin (0.1-1 s for SD,
  once per shape, `PRICED_SHAPES` kept): such a price is work that grows with the request, so it
  runs off the event loop (serving/scheduling/request_pricing.py) under the request's context: a run on the
  twin calls the check its caller set (RequestContext.bounding, models/probe_cache.py's
  `checked_by`) before each op it counts, and stops within one op of the request's end (start-up
  probes run unchecked).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vae_service.models.probe_cache import checkpoint
from vae_service.models.probe_store import Codec, integer, number, pair, sized
from vae_service.models.spec import ModelSpec

PROBE_SIDE = 16  # latent pixels per side of the smallest probe
CALIBRATION_FRAMES = 3  # latent frames (video): the first chunk and two steady ones
AFFINE_TOLERANCE = 0.01  # the third probe this close to the line through the first two: affine
PRICED_SHAPES = 256  # per-shape prices kept by a tier that is not affine


class LiveBytes(TorchDispatchMode):
    """Bytes of storage held by tensors that ops created and that are still referenced. Before each
    op, the check of the caller the run is for, if any (models/probe_cache.py's `checkpoint`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        checkpoint()
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.sizes:
            self.sizes[key], self.refs[key] = storage.nbytes(), 0
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.current -= self.sizes.pop(key)


TwinDecode = Callable[[nn.Module, torch.Tensor], Iterator[torch.Tensor]]  # (twin, z) -> output chunks


def probe_shapes(min_side: int) -> list[tuple[int, int]]:
    """Three latent shapes (h, w) of distinct pixel counts: two fix a line, the third checks it."""
    side = max(PROBE_SIDE, min_side)
    return [(side, side), (side + 8, side + 24), (side + 16, side + 4)]


@dataclass(frozen=True)
class Peak:
    working: int  # bytes at the decode's peak
    resident: int  # bytes held between chunks (the causal walk's history; 0 otherwise)


@dataclass(frozen=True)
class ModelFacts:
    """What every tier's price of one model shares."""

    dtype: torch.dtype
    itemsize: int
    latent_channels: int
    video: bool  # video latents
    scale: int
    min_side: int
    frames: int  # latent frames of a probe (video)
    chunked: bool  # decoded chunk by chunk (the causal walk): its working set does not grow with frames
    chunk_frames: int  # output frames of the largest chunk it hands over (1: whole clip at once)

    @property
    def per_latent_frame(self) -> bool:
        """The decoder takes the whole clip at once: its working set grows per latent frame."""
        return self.video and not self.chunked

    @classmethod
    def of(cls, spec: ModelSpec, dtype: torch.dtype) -> ModelFacts:
        geometry = spec.geometry
        chunked = spec.path == "causal_walk"
        frames = 1 if spec.family == "image" else max(CALIBRATION_FRAMES, geometry.min_latent_frames)
        counts = [spec.output_frames(t) for t in range(1, frames + 1)] if chunked else [1]
        return cls(
            dtype,
            torch.empty((), dtype=dtype).element_size(),
            geometry.latent_channels,
            geometry.video_latents,
            geometry.spatial_scale,
            geometry.min_latent_side,
            frames,
            chunked,
            max(b - a for a, b in zip([0, *counts], counts, strict=False)),
        )

    def answer(self, output_pixels: int, output: str) -> int:
        """What the answer holds: video keeps converted frames only (chunks are converted as they
        come); a `float` image is the decoder's output; a uint8 one is converted from it through
        an fp32 copy."""
        kept = 3 * (self.itemsize if output == "float" else 1)
        if self.video or output == "float":
            return output_pixels * kept
        return output_pixels * (3 * self.itemsize + 12 + kept)


class TwinRun:
    """Runs one tier's decode on the meta twin and counts what it holds. `lock`: the twin's, held by
    every run on it (tiers share the twin and its fast-path gate); `gate()`: the context the tier's
    runs need (high: the twin's gate on). A run stops within one op of its caller's check raising
    (LiveBytes)."""

    def __init__(
        self,
        twin: nn.Module,
        facts: ModelFacts,
        decode: TwinDecode,
        lock: threading.Lock,
        gate: Callable[[], object] | None = None,
    ):
        self.twin, self.facts, self.decode, self.gate, self._lock = twin, facts, decode, gate, lock

    def run(self, items: int, h: int, w: int, frames: int | None = None) -> tuple[int, int]:
        """(peak bytes, the most held between chunks) of decoding `frames` latent frames (default
        the probes')."""
        facts = self.facts
        dims = (frames or facts.frames,) if facts.video else ()
        z = torch.empty(items, facts.latent_channels, *dims, h, w, device="meta", dtype=facts.dtype)
        live, resident = LiveBytes(), 0
        with self._lock, torch.inference_mode(), self.gate() if self.gate else nullcontext(), live:
            for out in self.decode(self.twin, z):
                del out
                resident = max(resident, live.current)
        return live.peak, resident

    def measure(self, items: int, h: int, w: int) -> Peak:
        peak, resident = self.run(items, h, w)
        priced_frames = self.facts.frames if self.facts.per_latent_frame else 1
        return Peak(peak // priced_frames, resident if self.facts.chunked else 0)

    def warm(self) -> None:
        """One uncounted run: builds what the tier keeps between decodes (high's folded weights)."""
        self.run(1, *probe_shapes(self.facts.min_side)[0])


class TierPrice:
    """One tier's decode memory. `working` and `resident` per request shape; `constant_time`: every
    shape is priced by formula (else `needs_shape_work` says which shapes run the twin first)."""

    facts: ModelFacts
    constant_time = True
    # CUDA: what a real decode held beyond the count (allocator, cuDNN workspaces), per latent pixel
    # and constant (engine/pricing/calibration.py)
    correction: tuple[float, float] | None = None

    def peak(self, items: int, h: int, w: int) -> Peak:
        raise NotImplementedError

    def needs_shape_work(self, items: int, h: int, w: int) -> bool:
        return False

    def working(self, items: int, h: int, w: int, latent_frames: int = 1) -> int:
        frames = latent_frames if self.facts.per_latent_frame else 1
        rate, constant = self.correction or (0.0, 0.0)
        return max(0, int((self.peak(items, h, w).working + rate * items * h * w + constant) * frames))

    def resident(self, items: int, h: int, w: int) -> int:
        return self.peak(items, h, w).resident

    def calibrate(self, samples: list[tuple[int, int, int]]) -> None:
        """`samples`: two (h, w, bytes) where a real one-item decode of `facts.frames` latent frames
        held `bytes` at its peak; the difference from the count, as a line in latent pixels, is
        added to every price from now on (up or down)."""
        self.correction = None
        frames = self.facts.frames if self.facts.per_latent_frame else 1
        points = [(h * w, (held - self.working(1, h, w, self.facts.frames)) / frames) for h, w, held in samples]
        (px1, d1), (px2, d2) = points
        rate = (d2 - d1) / (px2 - px1)
        self.correction = (rate, d1 - rate * px1)

    def describe(self) -> dict:
        rate, constant = self.correction or (0.0, 0.0)
        return {
            "bytes_per_latent_pixel": round(self.rate + rate),
            "priced": "affine in pixels" if self.constant_time else "per shape",
            "calibrated": None
            if self.correction is None
            else {"bytes_per_latent_pixel": round(rate), "constant_bytes": round(constant)},
        }

    @property
    def rate(self) -> float:
        """Working bytes per latent pixel (at the smallest probe, where not affine)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Lines:
    """Per number: (bytes per latent pixel, constant bytes)."""

    working: tuple[float, float]
    resident: tuple[float, float]


class AffineTier(TierPrice):
    def __init__(self, facts: ModelFacts, lines: Lines):
        self.facts, self.lines = facts, lines

    def peak(self, items: int, h: int, w: int) -> Peak:
        px = items * h * w
        (rate, constant), (resident_rate, resident_constant) = self.lines.working, self.lines.resident
        return Peak(int(rate * px + constant), int(resident_rate * px + resident_constant))

    @property
    def rate(self) -> float:
        return self.lines.working[0]


class PerShapeTier(TierPrice):
    constant_time = False

    def __init__(self, run: TwinRun, first: Peak, first_pixels: int):
        self.facts, self._run = run.facts, run
        self._rate = first.working / first_pixels
        self._priced: OrderedDict[tuple[int, int, int], Peak] = OrderedDict()
        self._lock = threading.Lock()

    def _shape(self, items: int, h: int, w: int) -> tuple[int, int, int]:
        return items, max(h, self.facts.min_side), max(w, self.facts.min_side)

    def needs_shape_work(self, items: int, h: int, w: int) -> bool:
        return self._shape(items, h, w) not in self._priced

    def peak(self, items: int, h: int, w: int) -> Peak:
        key = self._shape(items, h, w)
        with self._lock:
            if key in self._priced:
                self._priced.move_to_end(key)
                return self._priced[key]
        found = self._run.measure(*key)
        with self._lock:
            self._priced[key] = found
            while len(self._priced) > PRICED_SHAPES:
                self._priced.popitem(last=False)
        return found

    @property
    def rate(self) -> float:
        return self._rate


def _encode_fit(fit: tuple[Lines | None, Peak, int]) -> dict:
    lines, first, pixels = fit
    return {
        "lines": None if lines is None else [list(lines.working), list(lines.resident)],
        "first": [first.working, first.resident],
        "pixels": pixels,
    }


def _decode_fit(data: dict) -> tuple[Lines | None, Peak, int]:
    lines = data["lines"]
    if lines is not None:
        working, resident = sized(lines, 2)
        lines = Lines(pair(working, number), pair(resident, number))
    return lines, Peak(*pair(data["first"], integer)), integer(data["pixels"])


FIT_CODEC = Codec(_encode_fit, _decode_fit)  # what fit_lines answers, kept by the probe store


def fit_lines(run: TwinRun) -> tuple[Lines | None, Peak, int]:
    """The tier's lines through three probes (None where the third is off the line through the
    first two), and the first probe's peak and pixels."""
    shapes = probe_shapes(run.facts.min_side)
    (px1, p1), (px2, p2), (px3, p3) = [(h * w, run.measure(1, h, w)) for h, w in shapes]
    lines = {}
    for name in ("working", "resident"):
        y1, y2, y3 = getattr(p1, name), getattr(p2, name), getattr(p3, name)
        rate = (y2 - y1) / (px2 - px1)
        lines[name] = (rate, y1 - rate * px1)
        if abs(rate * px3 + y1 - rate * px1 - y3) > AFFINE_TOLERANCE * max(y3, 1):
            return None, p1, px1
    return Lines(**lines), p1, px1
