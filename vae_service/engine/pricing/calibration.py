"""On CUDA, each tier's memory price checked against real decodes at start-up: the caching
allocator's peak (`max_memory_allocated`) over small decodes at two shapes, after a first run that
builds the fast path's folded weights and lets cuDNN pick its algorithms. The live-bytes count on
the meta twin cannot see cuDNN workspaces or the allocator's rounding; the difference, as a line
in latent pixels, corrects the tier's price (engine/pricing/memory.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from vae_service.engine.pricing.memory import TierPrice, probe_shapes


def calibrate_on_cuda(
    tier: TierPrice, decode: Callable[[torch.Tensor], Iterable[torch.Tensor]], device: torch.device
) -> list[tuple[int, int, int]]:
    """`decode(z)` runs the tier's real decode of `z` on `device`; returns the (h, w, peak) seen."""
    samples = []
    for h, w in probe_shapes(tier.facts.min_side)[:2]:
        frames = (tier.facts.frames,) if tier.facts.video else ()
        z = torch.randn(1, tier.facts.latent_channels, *frames, h, w, device=device, dtype=tier.facts.dtype)
        held = 0
        with torch.inference_mode():
            for _ in range(2):  # the first run builds folded weights and autotunes; the second counts
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                for out in decode(z):
                    del out
                torch.cuda.synchronize(device)
                held = torch.cuda.max_memory_allocated(device) - base
        samples.append((h, w, held))
    tier.calibrate(samples)
    return samples
