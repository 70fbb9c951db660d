"""What a decode costs in FLOPs, fitted once per architecture at start-up and priced in constant
time per request: FlopCounterMode over the decode on the meta device (shapes only, no compute) at
three latent sizes, and the exact curve through them, `a + b * P + c * P**2` per output frame
(P: latent pixels of one frame). Convolutions are linear in pixels; a mid-block attention over
the latent grid is quadratic, so a rate from a small latent misprices large ones (SD counts 9.46,
9.99 and 17.85 MFLOP per output pixel at latent sides 2, 128 and 512; the curve gives all three).
Video: counted over a few latent frames and divided by their output frames, so the first frame's
and later frames' costs mix as a clip mixes them; attention that spans frames (a whole-clip
mid-block) is priced per frame, as if it did not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from vae_service.models.probe_store import Codec, number, sized
from vae_service.models.spec import ModelSpec

PROBE_SIDE = 8  # latent pixels per side of the smallest count (or the model's minimum)


@dataclass(frozen=True)
class FlopModel:
    a: float  # FLOPs per output frame: a + b * P + c * P**2
    b: float
    c: float

    def per_frame(self, latent_pixels: int) -> float:
        p = float(latent_pixels)
        return max(0.0, self.a + self.b * p + self.c * p * p)

    def tflop(self, items: int, frames: int, h: int, w: int) -> float:
        return items * frames * self.per_frame(h * w) / 1e12

    def mflop_per_output_pixel(self, h: int, w: int, scale: int) -> float:
        return self.per_frame(h * w) / (h * w * scale * scale) / 1e6


FLOPS_CODEC = Codec(lambda m: [m.a, m.b, m.c], lambda data: FlopModel(*map(number, sized(data, 3))))


def fit_flops(
    twin: torch.nn.Module, spec: ModelSpec, decode: Callable[[torch.nn.Module, torch.Tensor], Iterator]
) -> FlopModel:
    """`twin`: the model on the meta device; `decode(twin, z)` yields the decode's output chunks."""
    geometry = spec.geometry
    latent_frames = 1 if spec.family == "image" else max(2, geometry.min_latent_frames)
    frames = (latent_frames,) if geometry.video_latents else ()
    side = max(PROBE_SIDE, geometry.min_latent_side)
    dtype = next(twin.parameters()).dtype
    points = []
    for h, w in ((side, side), (side, 2 * side), (2 * side, 2 * side)):
        z = torch.empty((1, spec.latent_channels, *frames, h, w), device="meta", dtype=dtype)
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            for _ in decode(twin, z):
                pass
        points.append((float(h * w), counter.get_total_flops() / spec.output_frames(latent_frames)))
    design = torch.tensor([[1.0, p, p * p] for p, _ in points], dtype=torch.float64)
    counts = torch.tensor([[f] for _, f in points], dtype=torch.float64)
    a, b, c = torch.linalg.solve(design, counts).flatten().tolist()
    return FlopModel(a, b, c)
