"""Norm + SiLU as one op, in the style of vLLM's custom ops: `forward_native` is the exact torch
composition, `forward_triton` the fused kernel, and `bind` picks one backend, once, at install.
A bound Triton op still falls back per call where its kernel declines the input (returns None)
or while torch.compile traces (an eager launch there would break the graph)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _bind(native: Callable, triton_op: Callable, backend: str) -> Callable:
    if backend == "torch":
        return native
    if backend != "triton":
        raise ValueError(f"unknown norm backend {backend!r}; allowed: ['triton', 'torch']")

    def triton_or_native(*args, **kwargs):
        if not torch.compiler.is_compiling():
            y = triton_op(*args, **kwargs)
            if y is not None:
                return y
        return native(*args, **kwargs)

    return triton_or_native


class GroupNormSiLU:
    """GroupNorm(x + in_bias) then SiLU; `in_bias` is an optional per-channel bias left over from
    the preceding conv (added inside the kernel instead of in a pass of its own)."""

    @staticmethod
    def forward_native(
        x: torch.Tensor, norm: nn.GroupNorm, silu: bool = True, in_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if in_bias is not None:
            x = x + in_bias.view(1, -1, *([1] * (x.dim() - 2)))
        y = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
        return F.silu(y, inplace=True) if silu else y

    @staticmethod
    def forward_triton(
        x: torch.Tensor, norm: nn.GroupNorm, silu: bool = True, in_bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if x.device.type == "meta":  # a meta twin pricing memory: the kernel allocates its output only
            return torch.empty_like(x)
        from vae_service.fastpath.kernels.group_norm import group_norm_silu_channels_last

        return group_norm_silu_channels_last(x, norm.num_groups, norm.weight, norm.bias, norm.eps, silu, in_bias)

    @classmethod
    def bind(cls, backend: str) -> Callable[..., torch.Tensor]:
        return _bind(cls.forward_native, cls.forward_triton, backend)


class WanRMSNormSiLU:
    """`norm` is diffusers' WanRMS_norm (channel-first): F.normalize(x, dim=1) * sqrt(C) * gamma + bias.
    `in_bias`: the preceding conv's bias, added to x first; `out`: where to write (else new)."""

    @staticmethod
    def forward_native(
        x: torch.Tensor, norm: nn.Module, in_bias: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # WanRMS_norm.forward's arithmetic, written out: the module's own forward is patched to
        # call this op while the fast path is on
        if in_bias is not None:
            x = x + in_bias.view(1, -1, *([1] * (x.dim() - 2)))
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        normalized = F.normalize(x.float() if low_precision else x, dim=1).to(x.dtype)
        y = F.silu(normalized * norm.scale * norm.gamma + norm.bias, inplace=True)
        return y if out is None else out.copy_(y)

    @staticmethod
    def forward_triton(
        x: torch.Tensor, norm: nn.Module, in_bias: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if x.device.type == "meta":  # a meta twin pricing memory: the kernel allocates its output only
            return torch.empty_like(x) if out is None else out
        from vae_service.fastpath.kernels.rms_norm import rms_norm_silu

        return rms_norm_silu(x, norm.gamma, norm.bias, norm.scale, in_bias=in_bias, out=out)

    @classmethod
    def bind(cls, backend: str) -> Callable[..., torch.Tensor]:
        return _bind(cls.forward_native, cls.forward_triton, backend)
