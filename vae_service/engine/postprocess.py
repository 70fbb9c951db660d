"""Decoder output ([-1, 1] floats, [B,3,H,W] or [B,3,T,H,W]) to the tensor a client gets, or the
pixels an encoder turns into files (engine/encoding.py).

uint8 follows diffusers' VaeImageProcessor exactly: (x / 2 + 0.5).clamp(0, 1) * 255, rounded,
computed in fp32, on the decoding device (a quarter of the bytes to copy to the host).
"""

from __future__ import annotations

import torch


def to_uint8(decoded: torch.Tensor) -> torch.Tensor:
    """-> [B, H, W, 3] (image) or [B, T, H, W, 3] (video), uint8, contiguous, on the CPU. In place
    after the first op: the same arithmetic without a temporary per step."""
    x = decoded.float() / 2
    x.add_(0.5).clamp_(0, 1).mul_(255).round_()
    return x.movedim(1, -1).to(torch.uint8, memory_format=torch.contiguous_format).cpu()


def postprocess(decoded: torch.Tensor, output: str) -> torch.Tensor:
    """`float`: the decoder's output on the CPU; anything else: uint8 pixels (encoded later)."""
    return decoded.cpu() if output == "float" else to_uint8(decoded)
