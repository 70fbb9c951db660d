"""Wan's channel-first RMSNorm (F.normalize over C, * sqrt(C) * gamma + bias) fused with SiLU.

x is [N, C, T, H, W] (or [N, C, H, W]) in any dense layout whose H and W merge into one index:
contiguous, channels-last(-3d), or [N, T, C, H, W] as Wan's spatial resampler leaves it. The
kernel takes the strides of the [N, C, T, H*W] view, so no activation is ever copied to fit it.
One program normalises a [BLOCK_S, C] tile in registers, in fp32, and writes once.

Epilogues of the Wan walk (engine/runtime/wan_walk.py): `in_bias`, the preceding conv's bias, is
added to x in registers (that conv runs without it: one pass fewer), and `out` is any view whose
H and W merge, e.g. the next causal conv's input buffer after its history frames (the norm's
output is written there directly instead of being copied in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vae_service.fastpath.kernels.support import kernel_takes

_MAX_CHANNELS = 4096
_TILE_ELEMS = 4096


@triton.jit
def _rms_silu_kernel(
    x_ptr,
    y_ptr,
    gamma_ptr,
    bias_ptr,
    in_bias_ptr,
    T,
    S,
    C,
    stride_n,
    stride_c,
    stride_t,
    stride_s,
    out_n,
    out_c,
    out_t,
    out_s,
    scale,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_IN_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    nt = tl.program_id(0).to(tl.int64)
    n, t = nt // T, nt % T
    s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_C)
    cmask = c < C
    mask = (s[:, None] < S) & cmask[None, :]
    offs = n * stride_n + t * stride_t + s[:, None] * stride_s + c[None, :].to(tl.int64) * stride_c
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_IN_BIAS:  # the conv's own rounding to the activation dtype comes first, as in torch
        x += tl.load(in_bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
        x = tl.where(mask, x, 0.0)
    norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
    gamma = tl.load(gamma_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    y = x / norm[:, None] * (scale * gamma)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    out_offs = n * out_n + t * out_t + s[:, None] * out_s + c[None, :].to(tl.int64) * out_c
    tl.store(y_ptr + out_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _dense(x: torch.Tensor) -> bool:
    """Elements fill exactly numel() slots in some dim order (what empty_like's layout keeps)."""
    expected = 1
    for size, stride in sorted((d for d in zip(x.shape, x.stride(), strict=True) if d[0] > 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _ncts_strides(x: torch.Tensor, dense: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Sizes and strides of x as [N, C, T, H*W], or None when H and W do not merge or (`dense`)
    the tensor is not dense (then empty_like would not keep its layout)."""
    if x.dim() == 4:
        x = x.unsqueeze(2)
    n, c, t, h, w = x.shape
    sn, sc, st, sh, sw = x.stride()
    if h > 1 and w > 1 and sh != w * sw:
        return None
    if dense and not _dense(x):
        return None
    ss = sw if w > 1 else sh
    return (n, c, t, h * w), (sn, sc, st, ss)


def rms_norm_silu(
    x: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | float,
    scale: float,
    silu: bool = True,
    eps: float = 1e-12,
    in_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Returns None for unsupported inputs (caller falls back). eps matches F.normalize's default.
    `in_bias` [C] is added to x first; `out` (x's shape and dtype, any strides whose H and W
    merge) receives the result, else a new tensor laid out like x."""
    if not kernel_takes(x) or x.dim() not in (4, 5) or x.numel() == 0:
        return None
    view = _ncts_strides(x)
    if view is None:
        return None
    (n, c, frames, spatial), strides = view
    if c > _MAX_CHANNELS or gamma.numel() != c:
        return None
    has_bias = isinstance(bias, torch.Tensor)
    if (has_bias and bias.numel() != c) or (not has_bias and bias != 0.0):
        return None
    if in_bias is not None and in_bias.numel() != c:
        return None
    y = torch.empty_like(x) if out is None else out  # a new one: same layout as x
    out_view = _ncts_strides(y, dense=False)
    if out_view is None or y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        return None
    block_c = triton.next_power_of_2(c)
    block_s = max(1, _TILE_ELEMS // block_c)
    gamma = gamma.reshape(-1).contiguous()
    bias_arg = bias.reshape(-1).contiguous() if has_bias else gamma  # never read without HAS_BIAS
    in_bias_arg = in_bias.reshape(-1).contiguous() if in_bias is not None else gamma
    _rms_silu_kernel[(n * frames, triton.cdiv(spatial, block_s))](
        x,
        y,
        gamma,
        bias_arg,
        in_bias_arg,
        frames,
        spatial,
        c,
        *strides,
        *out_view[1],
        float(scale),
        eps,
        HAS_BIAS=has_bias,
        HAS_IN_BIAS=in_bias is not None,
        SILU=silu,
        BLOCK_S=block_s,
        BLOCK_C=block_c,
    )
    return y
