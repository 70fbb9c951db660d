"""What a decode costs, estimated once per model: FLOPs per output pixel-frame, counted with
torch's FlopCounterMode over a small decode (2 latent frames for video VAEs, so that the first
frame's and later frames' costs are averaged the way a clip mixes them). The count covers the
convolutions and matmuls, which are nearly all of it (SD: ~9.5 MFLOP per pixel at 256-1024 px;
attention's share grows with size, ~5% at 1024 px)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from vae_service.models.spec import ModelSpec

_PROBE_LATENT_SIDE = 2


def flops_per_output_pixel(vae: torch.nn.Module, spec: ModelSpec) -> float:
    frames = (2,) if spec.family == "video" else ()
    weight = next(vae.parameters())
    z = torch.zeros(
        (1, spec.latent_channels, *frames, _PROBE_LATENT_SIDE, _PROBE_LATENT_SIDE),
        dtype=weight.dtype,
        device=weight.device,
    )
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        vae.decode(z)
    pixels = (_PROBE_LATENT_SIDE * spec.spatial_scale) ** 2 * (spec.output_frames(2) if frames else 1)
    return counter.get_total_flops() / pixels
