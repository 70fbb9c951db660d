"""Channels-last two-pass GroupNorm with an optional SiLU epilogue.

x is [N, C, *spatial] stored channels-last, i.e. rows of C values per pixel. Pass 1 reduces
chunks of rows per (sample, group) to a count, mean and sum of squared deviations in fp32;
a finalize kernel merges the chunks (Chan's parallel formula, stable where E[x^2] - E[x]^2
would cancel) and folds mean, rstd, weight and bias into a per-channel scale and shift;
pass 2 applies y = x * scale + shift, then SiLU, in one read and one write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vae_service.fastpath.kernels.support import channels_last_rows, kernel_takes

_MAX_CHUNKS = 1024  # per (sample, group): bounds the finalize kernel's single tile
_TILE_ELEMS = 2048  # elements one program loads at a time


@triton.jit
def _gn_partial_kernel(
    x_ptr,
    in_bias_ptr,
    mean_ptr,
    m2_ptr,
    rows,
    C,
    group_size,
    chunk_rows,
    num_chunks,
    HAS_IN_BIAS: tl.constexpr,
    SUB_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    chunk = tl.program_id(2)
    c = tl.arange(0, BLOCK_G)
    cmask = c < group_size
    if HAS_IN_BIAS:
        in_bias = tl.load(in_bias_ptr + g * group_size + c, mask=cmask, other=0.0).to(tl.float32)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, chunk_rows, SUB_R):
        r = chunk * chunk_rows + start + tl.arange(0, SUB_R)
        mask = (r[:, None] < rows) & (r[:, None] < (chunk + 1) * chunk_rows) & cmask[None, :]
        offs = n * rows * C + r[:, None].to(tl.int64) * C + g * group_size + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_IN_BIAS:
            x = tl.where(mask, x + in_bias[None, :], 0.0)
        n_b = tl.sum(tl.sum(mask.to(tl.float32), axis=1), axis=0)
        mean_b = tl.sum(tl.sum(x, axis=1), axis=0) / tl.maximum(n_b, 1.0)
        d = tl.where(mask, x - mean_b, 0.0)
        m2_b = tl.sum(tl.sum(d * d, axis=1), axis=0)
        # merge (count, mean, m2) with the block's, Chan et al.
        total = tl.maximum(count + n_b, 1.0)
        delta = mean_b - mean
        mean = mean + delta * n_b / total
        m2 = m2 + m2_b + delta * delta * count * n_b / total
        count = count + n_b
    out = (n * tl.num_programs(1) + g) * num_chunks + chunk
    tl.store(mean_ptr + out, mean)
    tl.store(m2_ptr + out, m2)


@triton.jit
def _gn_finalize_kernel(
    mean_ptr,
    m2_ptr,
    w_ptr,
    b_ptr,
    scale_ptr,
    shift_ptr,
    rows,
    C,
    group_size,
    chunk_rows,
    num_chunks,
    eps,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    base = (n * tl.num_programs(1) + g) * num_chunks
    k = tl.arange(0, BLOCK_K)
    kmask = k < num_chunks
    means = tl.load(mean_ptr + base + k, mask=kmask, other=0.0)
    m2s = tl.load(m2_ptr + base + k, mask=kmask, other=0.0)
    counts = tl.where(kmask, tl.minimum(rows - k * chunk_rows, chunk_rows).to(tl.float32) * group_size, 0.0)
    total = tl.sum(counts, axis=0)
    mean = tl.sum(means * counts, axis=0) / total
    dm = tl.where(kmask, means - mean, 0.0)
    var = (tl.sum(m2s, axis=0) + tl.sum(counts * dm * dm, axis=0)) / total
    rstd = 1.0 / tl.sqrt(var + eps)
    c = tl.arange(0, BLOCK_G)
    cmask = c < group_size
    ch = g * group_size + c
    w = tl.load(w_ptr + ch, mask=cmask, other=1.0).to(tl.float32)
    b = tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    scale = w * rstd
    tl.store(scale_ptr + n * C + ch, scale, mask=cmask)
    tl.store(shift_ptr + n * C + ch, b - mean * scale, mask=cmask)


@triton.jit
def _gn_apply_kernel(
    x_ptr,
    in_bias_ptr,
    y_ptr,
    scale_ptr,
    shift_ptr,
    rows,
    C,
    HAS_IN_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    mask = (r[:, None] < rows) & cmask[None, :]
    offs = n * rows * C + r[:, None].to(tl.int64) * C + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_IN_BIAS:
        x += tl.load(in_bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    scale = tl.load(scale_ptr + n * C + c, mask=cmask, other=0.0)
    shift = tl.load(shift_ptr + n * C + c, mask=cmask, other=0.0)
    y = x * scale[None, :] + shift[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def group_norm_silu_channels_last(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    silu: bool = True,
    in_bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """GroupNorm(+SiLU) of a channels-last tensor, or None when unsupported (caller falls back).
    `in_bias` (per channel) is added to x first: a preceding conv's bias, folded in for free."""
    if not kernel_takes(x) or not channels_last_rows(x) or weight is None or bias is None:
        return None
    n, c = x.shape[:2]
    if c % num_groups or x.numel() == 0 or (in_bias is not None and in_bias.numel() != c):
        return None
    has_in_bias = in_bias is not None
    in_bias = in_bias if has_in_bias else weight  # never read without HAS_IN_BIAS
    rows = x.numel() // (n * c)
    group_size = c // num_groups
    block_g = triton.next_power_of_2(group_size)
    sub_r = max(1, _TILE_ELEMS // block_g)
    chunk_rows = sub_r * triton.cdiv(triton.cdiv(rows, _MAX_CHUNKS), sub_r)
    num_chunks = triton.cdiv(rows, chunk_rows)
    stats = dict(device=x.device, dtype=torch.float32)
    means = torch.empty(n * num_groups * num_chunks, **stats)
    m2s = torch.empty_like(means)
    _gn_partial_kernel[(n, num_groups, num_chunks)](
        x,
        in_bias,
        means,
        m2s,
        rows,
        c,
        group_size,
        chunk_rows,
        num_chunks,
        HAS_IN_BIAS=has_in_bias,
        SUB_R=sub_r,
        BLOCK_G=block_g,
    )
    scale = torch.empty(n * c, **stats)
    shift = torch.empty_like(scale)
    _gn_finalize_kernel[(n, num_groups)](
        means,
        m2s,
        weight,
        bias,
        scale,
        shift,
        rows,
        c,
        group_size,
        chunk_rows,
        num_chunks,
        eps,
        BLOCK_K=triton.next_power_of_2(num_chunks),
        BLOCK_G=block_g,
    )
    y = torch.empty_like(x)  # keeps the channels-last strides
    block_c = min(triton.next_power_of_2(c), 128)
    block_r = max(1, 4096 // block_c)
    _gn_apply_kernel[(n, triton.cdiv(rows, block_r), triton.cdiv(c, block_c))](
        x, in_bias, y, scale, shift, rows, c, HAS_IN_BIAS=has_in_bias, SILU=silu, BLOCK_R=block_r, BLOCK_C=block_c
    )
    return y
