"""3x3 convolution by Winograd F(4x4, 3x3), for CPU decodes in fp32.

Each 6x6 input tile d gives a 4x4 output tile Y = A^T [(G g G^T) * (B^T d B)] A: 36
multiplies per 16 outputs instead of 144, i.e. the GEMM work drops 4x. The filter transform
U = G g G^T is folded once (in fp64) and kept as a folded buffer. Tiles are processed a few
tile-rows at a time so the transformed chunk (about 9 MB) stays in cache: unchunked, the
transforms are memory-bound and lose to oneDNN's direct convolution on large images.

Accuracy: max abs error about 3-4x that of the direct fp32 convolution against an fp64
reference (5e-5 vs 1.5e-5 on unit-scale activations), the price of the +-8 entries of A^T.
CUDA keeps cuDNN, which chooses its own (Winograd-capable) algorithms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_M, _A = 4, 6  # output tile, input tile
_BT = torch.tensor(
    [
        [4, 0, -5, 0, 1, 0],
        [0, -4, -4, 1, 1, 0],
        [0, 4, -4, -1, 1, 0],
        [0, -2, -1, 2, 1, 0],
        [0, 2, -1, -2, 1, 0],
        [0, 4, 0, -5, 0, 1],
    ],
    dtype=torch.float64,
)
_G = torch.tensor(
    [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ],
    dtype=torch.float64,
)
_AT = torch.tensor(
    [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], dtype=torch.float64
)
_INPUT_TRANSFORM = torch.kron(_BT, _BT).float()  # (36, 36) on flattened 6x6 tiles
_OUTPUT_TRANSFORM = torch.kron(_AT, _AT).float()  # (16, 36)
_CHUNK_BYTES = 9 * 2**20
MIN_CHANNELS = 64  # below this the tile GEMMs are too thin to beat the direct convolution


def winograd_applies(conv: nn.Conv2d, x: torch.Tensor) -> bool:
    # meta: the memory model prices a CPU engine's `high` graph on a meta twin (engine/pricing/memory.py)
    return (
        x.device.type in ("cpu", "meta")
        and x.dtype == torch.float32
        and type(conv) is nn.Conv2d
        and conv.kernel_size == (3, 3)
        and conv.stride == (1, 1)
        and conv.padding == (1, 1)
        and conv.dilation == (1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and min(conv.in_channels, conv.out_channels) >= MIN_CHANNELS
    )


def transform_filter(weight: torch.Tensor) -> torch.Tensor:
    """(Cout, Cin, 3, 3) -> U, (36, Cin, Cout)."""
    g = _G.to(weight.device)
    u = torch.einsum("ak,oikl,bl->abio", g, weight.double(), g)
    return u.reshape(_A * _A, weight.shape[1], weight.shape[0]).to(weight.dtype).contiguous()


def conv3x3_winograd(x: torch.Tensor, u: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same result as F.conv2d(x, w, bias, padding=1) up to float error; channels-last output."""
    n, c, h, w = x.shape
    cout = u.shape[2]
    tiles_h, tiles_w = -(-h // _M), -(-w // _M)
    padded = F.pad(x, (1, tiles_w * _M + 1 - w, 1, tiles_h * _M + 1 - h))
    out = torch.empty(n, tiles_h * _M, tiles_w * _M, cout, dtype=x.dtype, device=x.device)
    input_transform, output_transform = _INPUT_TRANSFORM.to(x.device), _OUTPUT_TRANSFORM.to(x.device)
    bytes_per_tile_row = _A * _A * n * tiles_w * max(c, cout) * x.element_size()
    rows_per_chunk = max(1, _CHUNK_BYTES // bytes_per_tile_row)
    bias = bias if bias is not None else torch.zeros(cout, dtype=x.dtype, device=x.device)
    for r0 in range(0, tiles_h, rows_per_chunk):
        rows = min(rows_per_chunk, tiles_h - r0)
        tiles = padded[:, :, r0 * _M : (r0 + rows) * _M + 2].unfold(2, _A, _M).unfold(3, _A, _M)
        d = tiles.permute(4, 5, 0, 2, 3, 1).reshape(_A * _A, -1)  # (36, tiles * C)
        v = (input_transform @ d).view(_A * _A, -1, c)
        m = torch.bmm(v, u)  # (36, tiles, Cout)
        y = (output_transform @ m.view(_A * _A, -1)).view(_M, _M, n, rows, tiles_w, cout)
        y = y.permute(2, 3, 0, 4, 1, 5).reshape(n, rows * _M, tiles_w * _M, cout)
        torch.add(y, bias, out=out[:, r0 * _M : (r0 + rows) * _M])
    out = out.permute(0, 3, 1, 2)  # logical NCHW, channels-last in memory
    if tiles_h * _M != h or tiles_w * _M != w:
        out = out[:, :, :h, :w].contiguous(memory_format=torch.channels_last)
    return out
