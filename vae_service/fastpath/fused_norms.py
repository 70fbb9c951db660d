"""Norm + SiLU as one op, in the style of vLLM's custom ops: `forward_native` is the exact torch
composition, `forward_triton` the fused kernel, and `dispatch` picks one in a single place."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vae_service.fastpath.kernels.support import triton_usable


def _triton_kernels():
    from vae_service.fastpath.kernels import group_norm, rms_norm

    return group_norm, rms_norm


class GroupNormSiLU:
    """GroupNorm(x + in_bias) then SiLU; `in_bias` is an optional per-channel bias left over from
    the preceding conv (added inside the kernel instead of in a pass of its own)."""

    @staticmethod
    def forward_native(x: torch.Tensor, norm: nn.GroupNorm, silu: bool, in_bias: torch.Tensor | None = None) -> torch.Tensor:
        if in_bias is not None:
            x = x + in_bias.view(1, -1, *([1] * (x.dim() - 2)))
        y = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
        return F.silu(y, inplace=True) if silu else y

    @staticmethod
    def forward_triton(x: torch.Tensor, norm: nn.GroupNorm, silu: bool, in_bias: torch.Tensor | None = None) -> torch.Tensor | None:
        group_norm, _ = _triton_kernels()
        return group_norm.group_norm_silu_channels_last(x, norm.num_groups, norm.weight, norm.bias, norm.eps, silu,
                                                        in_bias)

    @classmethod
    def dispatch(cls, x: torch.Tensor, norm: nn.GroupNorm, silu: bool = True,
                 in_bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and triton_usable(x):
            y = cls.forward_triton(x, norm, silu, in_bias)
            if y is not None:
                return y
        return cls.forward_native(x, norm, silu, in_bias)


class WanRMSNormSiLU:
    """`norm` is diffusers' WanRMS_norm (channel-first): F.normalize(x, dim=1) * sqrt(C) * gamma + bias."""

    @staticmethod
    def forward_native(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        # WanRMS_norm.forward's arithmetic, written out: the module's own forward is patched to
        # call this op while the fast path is on
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        normalized = F.normalize(x.float() if low_precision else x, dim=1).to(x.dtype)
        return F.silu(normalized * norm.scale * norm.gamma + norm.bias, inplace=True)

    @staticmethod
    def forward_triton(x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
        _, rms_norm = _triton_kernels()
        return rms_norm.rms_norm_silu(x, norm.gamma, norm.bias, norm.scale)

    @classmethod
    def dispatch(cls, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if x.is_cuda and triton_usable(x):
            y = cls.forward_triton(x, norm)
            if y is not None:
                return y
        return cls.forward_native(x, norm)
