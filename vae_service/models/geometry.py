"""A decoder's geometry, traced from its modules, never read from config fields.

Config fields such as Wan's `scale_factor_temporal` or LTX's `spatial_compression_ratio` are
stored by diffusers but build no module: a config whose field says 4x in time while its
upsamplers double time once decodes to other frame counts than the field promises. So the
geometry comes from running the decoder itself on the meta device (shapes only, no data, no
compute):

- latent channels: the input width of the first layer the latents reach (a pre-hook on every
  conv and linear layer stops the run there), confirmed by whole traces;
- latent rank: whether `decode` takes images [B, C, H, W] or videos [B, C, T, H, W];
- spatial scale: output pixels per latent pixel, per side, checked at two sizes (no offset), and
  the smallest latent side that decodes (LTX-2's reflect padding needs 2);
- frames per latent frame count (video latents): traced for every count from 1 to
  `TRACED_FRAMES`. Where one law `a * T + b` fits them all (Wan 4T - 3, LTX 8T - 7) it answers
  for every count. Where none does, the counts are searched for a law that repeats with a period
  (CogVideoX: 4T for even T, 4T - 3 for odd T: period 2; MiniMax-H3 and KVAE-video: 17 more frames
  every 5, 16 every 4, from their third count on), traced further where needed
  (`TRACED_FRAMES_IRREGULAR`) and accepted once it holds over two whole periods. A decoder with
  neither is traced per count when first asked (remembered, at most `TRACED_COUNTS_KEPT`), and
  `at_least(T)` bounds its frames without tracing (every latent frame decodes to at least one), so a
  count over the frame limit is refused before any trace. Such a trace is done for a request: it
  checks the request's context (models/probe_cache.py's `checked_by`, set by the engine) before
  each op on the twin, and a stopped trace is remembered as nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vae_service.models.errors import ModelLoadError
from vae_service.models.probe_cache import checking
from vae_service.models.probe_store import integer, pair

TRACE_SIDES = ((8, 12), (12, 20))  # latent (h, w): distinct per side, so a transposition shows
TRACED_FRAMES = 7  # latent frame counts traced at load (1..7)
TRACED_FRAMES_IRREGULAR = 18  # traced at load where no law fits the first ones
MAX_PERIOD = 5  # latent frames after which an irregular law may repeat
TRACED_COUNTS_KEPT = 256  # counts remembered for a decoder without any law
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)

Decode = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (meta vae, latents) -> decoded pixels


@dataclass(frozen=True)
class FrameLaw:
    """f(T) for every T from `start` on: f(start + k * period + r) = f(start + r) + k * step; below
    `start`, the traced counts themselves."""

    start: int
    period: int
    step: int
    known: tuple[tuple[int, int], ...]  # (T, f(T)) for the counts below start + period

    def __call__(self, latent_frames: int) -> int:
        known = dict(self.known)
        if latent_frames < self.start:
            return known[latent_frames]
        k, r = divmod(latent_frames - self.start, self.period)
        return known[self.start + r] + k * self.step

    @property
    def linear(self) -> tuple[int, int] | None:
        """(a, b) of f(T) = a * T + b when the law is one line from its first count."""
        if self.period != 1:
            return None
        a = self.step
        return a, dict(self.known)[self.start] - a * self.start


def find_law(traced: dict[int, int]) -> FrameLaw | None:
    """The law with the earliest start (one of the first counts) and then the shortest period that
    every traced count from its start on follows, seen over at least two whole periods."""
    counts = sorted(traced)
    for start in [t for t in counts if t <= counts[0] + MAX_PERIOD]:  # a law from one of the first counts
        for period in range(1, MAX_PERIOD + 1):
            pairs = [t for t in counts if t >= start and t + period in traced]
            if len(pairs) < 2 * period:
                break
            steps = {traced[t + period] - traced[t] for t in pairs}
            if len(steps) == 1 and (step := steps.pop()) >= period:
                known = tuple((t, traced[t]) for t in counts if t < start + period)
                return FrameLaw(start, period, step, known)
    return None


class FrameCounts:
    """Output frames per latent frame count: a law where the traced counts follow one, else a trace
    per count on the meta twin (`trace(t)` raises where t does not decode)."""

    def __init__(self, traced: dict[int, int], trace: Callable[[int], int]):
        self.traced, self._trace, self._lock = dict(traced), trace, threading.Lock()
        self.min_latent_frames = min(traced)
        self.rule = find_law(self.traced)

    @property
    def law(self) -> tuple[int, int] | None:
        """(a, b) where f(T) = a * T + b for every count (Wan 4T - 3)."""
        return self.rule.linear if self.rule is not None and self.rule.start <= self.min_latent_frames else None

    def needs_trace(self, latent_frames: int) -> bool:
        """Whether answering for this count would run the decoder's trace (work that grows with it)."""
        return self.rule is None and latent_frames not in self.traced

    def at_least(self, latent_frames: int) -> int:
        """A bound from below, without tracing: every latent frame decodes to at least one frame."""
        if not self.needs_trace(latent_frames):
            return self(latent_frames)
        return max(latent_frames, max((f for t, f in self.traced.items() if t <= latent_frames), default=1))

    def __call__(self, latent_frames: int) -> int:
        if self.rule is not None and latent_frames >= self.rule.start:
            return self.rule(latent_frames)
        if latent_frames not in self.traced:
            with self._lock:
                if latent_frames not in self.traced:
                    frames = self._trace(latent_frames)
                    if len(self.traced) >= TRACED_COUNTS_KEPT:
                        self.traced.pop(max(self.traced))  # the longest: the rarest
                    self.traced[latent_frames] = frames
        return self.traced[latent_frames]

    def describe(self) -> str:
        law = self.law
        if law is not None:
            a, b = law
            return f"{a} * T {'-' if b < 0 else '+'} {abs(b)}"
        if self.rule is not None:
            r = self.rule
            first = ", ".join(f"{t} -> {f}" for t, f in r.known)
            return f"{first}; then {r.step} more every {r.period} latent frames"
        return "traced per latent frame count: " + ", ".join(f"{t} -> {self.traced[t]}" for t in sorted(self.traced))


@dataclass(frozen=True)
class Geometry:
    latent_channels: int
    video_latents: bool  # decode takes [B, C, T, H, W] (else [B, C, H, W])
    spatial_scale: int  # output pixels per latent pixel, per side
    min_latent_side: int = 1
    frames: FrameCounts | None = field(default=None, compare=False)  # video latents

    def output_frames(self, latent_frames: int) -> int:
        return self.frames(latent_frames) if self.frames is not None else 1

    @property
    def min_latent_frames(self) -> int:
        return self.frames.min_latent_frames if self.frames is not None else 1

    def describe(self) -> dict:
        found = {
            "latent_channels": self.latent_channels,
            "latent_layout": "[B, C, T, H, W]" if self.video_latents else "[B, C, H, W]",
            "spatial_scale": self.spatial_scale,
            "min_latent_side": self.min_latent_side,
        }
        if self.frames is not None:
            found["output_frames"] = self.frames.describe()
            found["min_latent_frames"] = self.min_latent_frames
        return found


class _FirstLayer(Exception):
    def __init__(self, layer: nn.Module):
        self.layer = layer


def _first_layer(vae: nn.Module, decode: Decode, video: bool) -> nn.Module | None:
    """The first conv or linear layer that latents of that rank reach (a pre-hook stops there)."""

    def stop(module: nn.Module, args) -> None:
        raise _FirstLayer(module)

    handles = [m.register_forward_pre_hook(stop) for m in vae.modules() if isinstance(m, _LAYERS)]
    try:
        decode(vae, _latents(1, video, 3, *TRACE_SIDES[0]))
    except _FirstLayer as found:
        return found.layer
    except Exception:  # this rank, or the probe's single channel, failed before any layer
        return None
    finally:
        for handle in handles:
            handle.remove()
    return None


def _latents(channels: int, video: bool, frames: int, h: int, w: int) -> torch.Tensor:
    shape = (1, channels, frames, h, w) if video else (1, channels, h, w)
    return torch.empty(shape, device="meta")


class _Tracer:
    """Decoded (frames, height, width) per latent shape, for one channel count and rank."""

    def __init__(self, vae: nn.Module, decode: Decode, channels: int, video: bool):
        self.vae, self.decode, self.channels, self.video = vae, decode, channels, video

    def __call__(self, frames: int, h: int, w: int) -> tuple[int, int, int]:
        with torch.inference_mode(), checking():  # the caller's check, if any, before each op
            out = self.decode(self.vae, _latents(self.channels, self.video, frames, h, w))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        if shape is None or len(shape) != (5 if self.video else 4) or shape[:2] != (1, 3):
            layout = "[1, 3, T, H, W]" if self.video else "[1, 3, H, W]"
            raise ValueError(f"decodes to {list(shape) if shape else type(out).__name__}, not RGB pixels {layout}")
        return (shape[2] if self.video else 1), shape[-2], shape[-1]

    def frames(self, t: int) -> int:
        return self(t, *TRACE_SIDES[0])[0]


def trace_geometry(
    vae: nn.Module, decode: Decode, channel_hints: tuple[int, ...] = (), single_frame: bool = False
) -> Geometry:
    """`vae` lives on the meta device; `decode(vae, z)` runs the decode the service serves.
    `channel_hints`: config fields to try after the first layer's width (a decoder that reshapes
    its latents before any layer). `single_frame`: video latents of one frame only (image models
    with a video decoder: Qwen-Image)."""
    failures: list[str] = []
    first = _first_layer(vae, decode, video=False) or _first_layer(vae, decode, video=True)
    widths = (first.in_features if isinstance(first, nn.Linear) else first.in_channels,) if first is not None else ()
    ranks = (True, False) if isinstance(first, nn.Conv3d) else (False, True)
    for video in ranks:
        for channels in dict.fromkeys((*widths, *channel_hints)):
            try:
                return _trace(_Tracer(vae, decode, channels, video), single_frame)
            except Exception as exc:
                failures.append(f"{channels} channels, {'video' if video else 'image'} latents: {exc}")
    raise ModelLoadError(
        f"model: could not trace the decoder of {type(vae).__name__} on the meta device "
        f"({'; '.join(failures[:4]) or 'no layer takes the latents'})"
    )


def encode_geometry(geometry: Geometry) -> dict:
    """What the probe store keeps of a traced geometry (models/probe_store.py)."""
    frames = geometry.frames
    return {
        "channels": geometry.latent_channels,
        "video": geometry.video_latents,
        "scale": geometry.spatial_scale,
        "min_side": geometry.min_latent_side,
        "traced": None if frames is None else sorted(frames.traced.items()),
    }


def decode_geometry(data: dict, build_twin: Callable[[], nn.Module], decode: Decode) -> Geometry:
    """A kept geometry; a video decoder without a frame law traces further counts on a twin that
    `build_twin` makes when first needed."""
    channels, video = integer(data["channels"]), data["video"]
    if not isinstance(video, bool):
        raise ValueError(f"video: expected a boolean, got {video!r}")
    counts = None
    if data["traced"] is not None:
        traced = dict(pair(entry, integer) for entry in data["traced"])
        if not traced or not video:
            raise ValueError("traced frame counts of an image decoder, or none")
        tracers: list[_Tracer] = []

        def frames(t: int) -> int:  # called under FrameCounts' lock
            if not tracers:
                tracers.append(_Tracer(build_twin(), decode, channels, video))
            return tracers[0].frames(t)

        counts = FrameCounts(traced, frames)
    elif video:
        raise ValueError("a video decoder without traced frame counts")
    return Geometry(channels, video, integer(data["scale"]), integer(data["min_side"]), counts)


def _trace_counts(tracer: _Tracer, counts: range, traced: dict[int, int]) -> None:
    for t in counts:
        try:
            traced[t] = tracer.frames(t)
        except Exception:
            if traced:  # a gap after a count that decoded: not a frame law we can serve
                raise


def _trace(tracer: _Tracer, single_frame: bool) -> Geometry:
    traced: dict[int, int] = {}
    if tracer.video:
        _trace_counts(tracer, range(1, 2 if single_frame else TRACED_FRAMES + 1), traced)
        if not traced:
            raise ValueError(f"no latent frame count from 1 to {TRACED_FRAMES} decodes")
        if not single_frame and find_law(traced) is None:
            _trace_counts(tracer, range(TRACED_FRAMES + 1, TRACED_FRAMES_IRREGULAR + 1), traced)
    frames = min(traced) if traced else 1
    (h1, _), (h2, _) = TRACE_SIDES
    sizes = [tracer(frames, h, w) for h, w in TRACE_SIDES]
    scale = (sizes[1][1] - sizes[0][1]) // (h2 - h1)
    for (h, w), (_, height, width) in zip(TRACE_SIDES, sizes, strict=True):
        if scale < 1 or (height, width) != (scale * h, scale * w):
            raise ValueError(f"latents {h}x{w} decode to {height}x{width}: not a whole scale of the latent size")
    min_side = next((s for s in range(1, h1) if _decodes(tracer, frames, s)), h1)
    counts = FrameCounts(traced, tracer.frames) if tracer.video else None
    return Geometry(tracer.channels, tracer.video, scale, min_side, counts)


def _decodes(tracer: _Tracer, frames: int, side: int) -> bool:
    try:
        tracer(frames, side, side)
    except Exception:
        return False
    return True
