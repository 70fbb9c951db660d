"""Nearest-2x upsample followed by a 3x3, stride-1, padding-1 conv equals one stride-2,
padding-1 transposed conv with a 4x4 kernel. Per dimension the taps are
K = [w2, w1 + w2, w0 + w1, w0] (even outputs see x[i-1] * w0 + x[i] * (w1 + w2), odd ones
x[i] * (w0 + w1) + x[i+1] * w2); in 2-D, K = F W F^T with F below. The result is exact up to
float reassociation and costs 4/9 of the conv's FLOPs."""

from __future__ import annotations

import torch

_FOLD = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def fold_upsample_conv(weight: torch.Tensor) -> torch.Tensor:
    """(Cout, Cin, 3, 3) conv weight -> (Cin, Cout, 4, 4) conv_transpose2d weight, folded in fp32."""
    f = _FOLD.to(weight.device)
    folded = torch.einsum("ak,oikl,bl->ioab", f, weight.float(), f)
    return folded.to(weight.dtype).contiguous(memory_format=torch.channels_last)
