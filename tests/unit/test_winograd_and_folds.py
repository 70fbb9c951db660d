"""The structural rewrites, layer by layer, against float64 references."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vae_service.fastpath.winograd as winograd
from vae_service.fastpath.upsample_fold import fold_upsample_conv


def conv_case(cin, cout, h, w, n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(cin, cout, 3, padding=1).requires_grad_(False)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (cin * 9) ** -0.5)
        conv.bias.copy_(torch.randn(cout, generator=g))
    x = torch.randn(n, cin, h, w, generator=g).contiguous(memory_format=torch.channels_last)
    return conv, x


@pytest.mark.parametrize("shape", [(1, 64, 1, 1), (2, 64, 5, 7), (1, 96, 13, 9), (1, 64, 16, 16), (3, 64, 4, 12)])
def test_winograd_matches_direct_convolution(shape):
    n, c, h, w = shape
    conv, x = conv_case(c, 80, h, w, n)
    exact = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    direct_err = (conv(x).double() - exact).abs().max().item()
    out = winograd.conv3x3_winograd(x, winograd.transform_filter(conv.weight), conv.bias)
    assert out.shape == exact.shape and out.is_contiguous(memory_format=torch.channels_last)
    err = (out.double() - exact).abs().max().item()
    # documented in winograd.py: a few times the direct conv's error, ~5e-5 on unit-scale activations
    assert err < max(10 * direct_err, 1e-4), (err, direct_err)


def test_winograd_chunking_covers_every_tile_row(monkeypatch):
    monkeypatch.setattr(winograd, "_CHUNK_BYTES", 1)  # one tile row per chunk
    conv, x = conv_case(64, 64, 18, 10, n=2)
    out = winograd.conv3x3_winograd(x, winograd.transform_filter(conv.weight), None)
    torch.testing.assert_close(out, F.conv2d(x, conv.weight, None, padding=1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "conv, x, applies",
    [
        (nn.Conv2d(64, 64, 3, padding=1), torch.zeros(1, 64, 4, 4), True),
        (nn.Conv2d(32, 64, 3, padding=1), torch.zeros(1, 32, 4, 4), False),
        (nn.Conv2d(64, 64, 3, padding=1, stride=2), torch.zeros(1, 64, 4, 4), False),
        (nn.Conv2d(64, 64, 1), torch.zeros(1, 64, 4, 4), False),
        (nn.Conv2d(64, 64, 3, padding=1), torch.zeros(1, 64, 4, 4, dtype=torch.bfloat16), False),
        (nn.Conv2d(64, 64, 3, padding=1, padding_mode="reflect"), torch.zeros(1, 64, 4, 4), False),
    ],
)
def test_winograd_only_where_it_applies(conv, x, applies):
    assert winograd.winograd_applies(conv, x) is applies


@pytest.mark.parametrize("h, w", [(1, 1), (3, 5), (8, 8), (7, 2)])
def test_upsample_fold_equals_nearest_upsample_then_conv(h, w):
    conv, x = conv_case(8, 6, h, w, n=2, seed=h * w)
    exact = F.conv2d(
        F.interpolate(x.double(), scale_factor=2.0, mode="nearest"), conv.weight.double(), conv.bias.double(), padding=1
    )
    folded = F.conv_transpose2d(x, fold_upsample_conv(conv.weight), conv.bias, stride=2, padding=1)
    assert folded.shape == exact.shape == (2, 6, 2 * h, 2 * w)
    assert (folded.double() - exact).abs().max().item() < 1e-5
