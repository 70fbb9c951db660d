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
  for every count; where none does (CogVideoX: 4T for even T, 4T - 3 for odd T), each count is
  traced when first asked for and remembered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vae_service.models.errors import ModelLoadError

TRACE_SIDES = ((8, 12), (12, 20))  # latent (h, w): distinct per side, so a transposition shows
TRACED_FRAMES = 7  # latent frame counts traced at load (1..7)
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)

Decode = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (meta vae, latents) -> decoded pixels


class FrameCounts:
    """Output frames per latent frame count: a linear law where one fits every traced count, else
    a trace per count on the meta twin (memoised; `trace(t)` raises where t does not decode)."""

    def __init__(self, traced: dict[int, int], trace: Callable[[int], int]):
        self.traced, self._trace, self._lock = dict(traced), trace, threading.Lock()
        counts = sorted(traced)
        self.law: tuple[int, int] | None = None
        if len(counts) >= 2:
            t1, t2 = counts[-2:]
            a = (traced[t2] - traced[t1]) // (t2 - t1)
            b = traced[t2] - a * t2
            if a >= 1 and all(traced[t] == a * t + b for t in counts):
                self.law = (a, b)

    @property
    def min_latent_frames(self) -> int:
        return min(self.traced)

    def __call__(self, latent_frames: int) -> int:
        if self.law is not None:
            a, b = self.law
            return a * latent_frames + b
        if latent_frames not in self.traced:
            with self._lock:
                if latent_frames not in self.traced:
                    self.traced[latent_frames] = self._trace(latent_frames)
        return self.traced[latent_frames]

    def describe(self) -> str:
        if self.law is None:
            return "traced per latent frame count: " + ", ".join(
                f"{t} -> {self.traced[t]}" for t in sorted(self.traced)
            )
        a, b = self.law
        return f"{a} * T {'-' if b < 0 else '+'} {abs(b)}"


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
        with torch.inference_mode():
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


def _trace(tracer: _Tracer, single_frame: bool) -> Geometry:
    traced: dict[int, int] = {}
    if tracer.video:
        for t in range(1, 2 if single_frame else TRACED_FRAMES + 1):
            try:
                traced[t] = tracer.frames(t)
            except Exception:
                if traced:  # a gap after a count that decoded: not a frame law we can serve
                    raise
        if not traced:
            raise ValueError(f"no latent frame count from 1 to {TRACED_FRAMES} decodes")
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
