"""On CUDA, each tier's memory price checked against real decodes at start-up: the caching
allocator's peak (`max_memory_allocated`) over a small decode, after a first run that builds the
fast path's folded weights and lets cuDNN pick its algorithms. The live-bytes count on the meta
twin cannot see cuDNN workspaces or the Triton kernels' own buffers; the tier's price is scaled up
by what it missed (never down)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from vae_service.engine.memory import CALIBRATION_SHAPES, TierMemory


def calibrate_on_cuda(
    tier: TierMemory, decode: Callable[[torch.Tensor], Iterable[torch.Tensor]], device: torch.device
) -> int:
    """`decode(z)` runs the tier's real decode of `z` on `device`; returns the measured peak."""
    h, w = (max(side, tier.min_side) for side in CALIBRATION_SHAPES[0])
    frames = (tier.frames,) if tier.video else ()
    z = torch.randn(1, tier.latent_channels, *frames, h, w, device=device, dtype=tier.dtype)
    measured = 0
    with torch.inference_mode():
        for _ in range(2):  # the first run builds folded weights and autotunes; the second is measured
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            for out in decode(z):
                del out
            torch.cuda.synchronize(device)
            measured = torch.cuda.max_memory_allocated(device) - base
    tier.calibrate(measured, 1, h, w, tier.frames)
    return measured
