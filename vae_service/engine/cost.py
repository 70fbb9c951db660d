"""What a decode costs, estimated once per model: FLOPs per output pixel-frame, counted with
torch's FlopCounterMode over a small decode on the meta device (no compute; for video decoders 2
latent frames, or their minimum, so that the first frame's and later frames' costs are averaged
the way a clip mixes them). The count covers the convolutions and matmuls, which are nearly all
of it (SD: ~9.5 MFLOP per pixel at 256-1024 px; attention's share grows with size, ~5% at
1024 px)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from vae_service.models.spec import ModelSpec

_PROBE_LATENT_SIDE = 2


def flops_per_output_pixel(
    twin: torch.nn.Module, spec: ModelSpec, decode: Callable[[torch.nn.Module, torch.Tensor], Iterator]
) -> float:
    """`twin`: the model on the meta device; `decode(twin, z)` yields the decode's output chunks."""
    geometry = spec.geometry
    latent_frames = 1 if spec.family == "image" else max(2, geometry.min_latent_frames)
    frames = (latent_frames,) if geometry.video_latents else ()
    side = max(_PROBE_LATENT_SIDE, geometry.min_latent_side)
    z = torch.empty((1, spec.latent_channels, *frames, side, side), device="meta")
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        for _ in decode(twin, z):
            pass
    pixels = (side * spec.spatial_scale) ** 2 * spec.output_frames(latent_frames)
    return counter.get_total_flops() / pixels
