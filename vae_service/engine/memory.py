"""Peak decode memory per tier, model and shape, without decoding anything: the tier's own graph
(for `high`, the fast path installed on the twin with the rewrites the real device runs) runs on
the meta device (shapes only, no data, no compute) while a dispatch mode counts the bytes of live
tensor storage. For the same graph it counts what a real CPU decode holds to within 0.1%
(measured on the 64-channel test decoder); a request's estimate adds the answer's conversion
(engine/memory_plan.py) and is tested within 10% of a real decode's peak.

- `working`: the peak while decoding one request's items (one latent frame at a time for the
  causal walk, its causal history included; per latent frame for video decoders that take a clip
  at once);
- `resident`: what a video decode holds between chunks (the causal history), which every tile of
  a tiled decode keeps at once.

Most graphs hold bytes affine in latent pixels (linear for both tiers of SD, FLUX, Wan2.1 and the
tiny presets; the folded weights `high` builds once are held, priced apart): three probes check
it and fix the two numbers for every shape. CPU fp32 `high` of a wide image
decoder is not affine: Winograd works in cache-sized chunks, so its scratch stops growing past a
few hundred pixels per side (SD at 1024 px holds 35% of what a rate from 128 px predicts). Such
a graph is priced per shape on the twin (0.1-1 s for SD, once per shape: cached).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vae_service.models.spec import ModelSpec

PROBE_SIDE = 16  # latent pixels per side of the smallest probe
CALIBRATION_FRAMES = 3  # latent frames (video): the first chunk and two steady ones
AFFINE_TOLERANCE = 0.01  # the third probe this close to the line through the first two: affine
PRICED_SHAPES = 256  # per-shape prices kept by a tier that is not affine
LONG_CLIP = 12  # latent frames: a whole-clip decode's price beyond, extrapolated from two probes
LONG_CLIP_PROBES = (LONG_CLIP // 2, LONG_CLIP)
# probed lines of affine tiers, per (class, config, dtype, device, rewrites, tier): engines of the
# same model in one process (tests, benchmarks) probe once
_PROBED: dict[tuple, tuple[dict, float]] = {}


class LiveBytes(TorchDispatchMode):
    """Bytes of storage held by tensors that ops created and that are still referenced."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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


Decode = Callable[[nn.Module, torch.Tensor], Iterator[torch.Tensor]]


def probe_shapes(min_side: int) -> list[tuple[int, int]]:
    """Three latent shapes (h, w) of distinct pixel counts: two fix a line, the third checks it."""
    side = max(PROBE_SIDE, min_side)
    return [(side, side), (side + 8, side + 24), (side + 16, side + 4)]


@dataclass(frozen=True)
class Peak:
    working: int  # bytes at the decode's peak
    resident: int  # bytes held between chunks (the causal walk's history; 0 otherwise)


class TierMemory:
    """One tier's decode memory: `decode(twin, z)` yields that tier's output chunks on the meta
    `twin` (each dropped at once, as the engine converts or streams them). `lock`: the twin's, held
    by every run on it (tiers share the twin and its fast-path gate); `gate()`: the context the
    tier's runs need (high: the twin's gate on)."""

    def __init__(
        self,
        twin: nn.Module,
        spec: ModelSpec,
        decode: Decode,
        lock: threading.Lock,
        gate: Callable[[], object] | None = None,
        cache_key: tuple | None = None,
        per_shape: bool = False,
        whole_clip: bool = False,
    ):
        self.twin, self.decode, self.gate, self._lock = twin, decode, gate, lock
        geometry = spec.geometry
        self.dtype = next(twin.parameters()).dtype
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.latent_channels = geometry.latent_channels
        self.video, self.scale = geometry.video_latents, geometry.spatial_scale
        self.min_side = geometry.min_latent_side
        # `whole_clip`: the class's own decode (its tiled decode) of a causal model: not chunked
        self.chunked = spec.path == "causal_walk" and not whole_clip
        self.frames = 1 if spec.family == "image" else max(CALIBRATION_FRAMES, geometry.min_latent_frames)
        self.per_latent_frame = self.video and not self.chunked  # the decoder takes the whole clip at once
        # a whole-clip tiled decode holds every tile's output frames until the blend, beside a
        # working set that does not grow with the clip (the larger decides the peak): priced per
        # shape and clip length (Wan's output frames per latent frame grow from 3 towards 4)
        self.output_frames = spec.output_frames if whole_clip and self.video else None
        self._clip_peaks = lru_cache(maxsize=PRICED_SHAPES)(self._clip_peak)
        # the causal walk's largest chunk in output frames (other decoders hand over the whole clip)
        counts = [spec.output_frames(t) for t in range(1, self.frames + 1)] if self.chunked else [1]
        self.chunk_frames = max(b - a for a, b in zip([0, *counts], counts, strict=False))
        # CUDA: what a real decode held beyond the count (allocator, cuDNN workspaces), per latent
        # pixel and constant, per latent frame where the decoder takes the whole clip
        self.correction: tuple[float, float] | None = None
        self._priced = lru_cache(maxsize=PRICED_SHAPES)(self._measure)
        if per_shape:  # a graph known not to be affine (a tiled decode: its tiles' count steps)
            h, w = probe_shapes(self.min_side)[0]
            self.lines, self.affine = None, False
            self.working_per_latent_px = self._priced(1, h, w).working / (h * w)
            return
        if cache_key in _PROBED:
            self.lines, self.working_per_latent_px = _PROBED[cache_key]
            self.affine = True
            return
        shapes = probe_shapes(self.min_side)
        if gate is not None:
            self._run(1, *shapes[0])  # uncounted: builds the fast path's folded weights
        (px1, p1), (px2, p2), (px3, p3) = [(h * w, self._priced(1, h, w)) for h, w in shapes]
        self.lines = {}  # per number: (bytes per latent pixel, constant bytes)
        for name in ("working", "resident"):
            y1, y2, y3 = getattr(p1, name), getattr(p2, name), getattr(p3, name)
            rate = (y2 - y1) / (px2 - px1)
            self.lines[name] = (rate, y1 - rate * px1)
            if abs(rate * px3 + y1 - rate * px1 - y3) > AFFINE_TOLERANCE * max(y3, 1):
                self.lines = None
                break
        self.affine = self.lines is not None  # priced by formula, not per shape
        self.working_per_latent_px = self.lines["working"][0] if self.affine else p1.working / px1
        if self.affine and cache_key is not None:
            _PROBED[cache_key] = (self.lines, self.working_per_latent_px)

    def _run(self, items: int, h: int, w: int, live: LiveBytes | None = None, frames: int | None = None) -> int:
        """Decode on the twin (`frames` latent frames: default the probes'); the most bytes `live`
        saw held between chunks."""
        frames = (frames or self.frames,) if self.video else ()
        z = torch.empty(items, self.latent_channels, *frames, h, w, device="meta", dtype=self.dtype)
        resident = 0
        with self._lock, torch.inference_mode(), self.gate() if self.gate else nullcontext(), live or nullcontext():
            for out in self.decode(self.twin, z):
                del out
                resident = max(resident, live.current if live else 0)
        return resident

    def _measure(self, items: int, h: int, w: int) -> Peak:
        live = LiveBytes()
        resident = self._run(items, h, w, live)
        frames_priced = self.frames if self.per_latent_frame else 1
        return Peak(live.peak // frames_priced, resident if self.chunked else 0)

    def _peak(self, items: int, h: int, w: int) -> Peak:
        if self.lines is None:
            return self._priced(items, max(h, self.min_side), max(w, self.min_side))
        px = items * h * w
        (rate, constant), (resident_rate, resident_constant) = self.lines["working"], self.lines["resident"]
        return Peak(int(rate * px + constant), int(resident_rate * px + resident_constant))

    def _clip_peak(self, items: int, h: int, w: int, latent_frames: int) -> int:
        live = LiveBytes()
        self._run(items, h, w, live, latent_frames)
        return live.peak

    def working(self, items: int, h: int, w: int, latent_frames: int = 1) -> int:
        if self.output_frames is not None:
            # counted as is up to LONG_CLIP latent frames; longer clips on the line through the
            # last two probes: their held frames dominate the decoder's working set by then
            h, w = max(h, self.min_side), max(w, self.min_side)
            if latent_frames <= LONG_CLIP:
                return self._clip_peaks(items, h, w, latent_frames)
            (f1, p1), (f2, p2) = [(self.output_frames(t), self._clip_peaks(items, h, w, t)) for t in LONG_CLIP_PROBES]
            return int(p2 + (p2 - p1) / (f2 - f1) * (self.output_frames(latent_frames) - f2))
        frames = latent_frames if self.per_latent_frame else 1
        rate, constant = self.correction or (0.0, 0.0)
        return max(0, int((self._peak(items, h, w).working + rate * items * h * w + constant) * frames))

    def resident(self, items: int, h: int, w: int) -> int:
        return self._peak(items, h, w).resident

    def answer(self, output_pixels: int, output: str) -> int:
        """What the answer holds: video keeps converted frames only (chunks are converted as they
        come); a `float` image is the decoder's output; a uint8 one is converted from it through
        an fp32 copy."""
        kept = 3 * (self.itemsize if output == "float" else 1)
        if self.video or output == "float":
            return output_pixels * kept
        return output_pixels * (3 * self.itemsize + 12 + kept)

    def calibrate(self, samples: list[tuple[int, int, int]]) -> None:
        """`samples`: two (h, w, bytes) where a real one-item decode of `self.frames` latent frames
        held `bytes` at its peak; the difference from the count, as a line in latent pixels, is
        added to every price from now on (up or down)."""
        self.correction = None
        frames = self.frames if self.per_latent_frame else 1
        (px1, d1), (px2, d2) = [(h * w, (held - self.working(1, h, w, self.frames)) / frames) for h, w, held in samples]
        rate = (d2 - d1) / (px2 - px1)
        self.correction = (rate, d1 - rate * px1)

    def describe(self) -> dict:
        rate, constant = self.correction or (0.0, 0.0)
        return {
            "bytes_per_latent_pixel": round(self.working_per_latent_px + rate),
            "priced": "affine in pixels" if self.affine else "per shape",
            "calibrated": None
            if self.correction is None
            else {"bytes_per_latent_pixel": round(rate), "constant_bytes": round(constant)},
        }
