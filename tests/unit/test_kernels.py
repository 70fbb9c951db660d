"""Triton kernels against the torch reference, in interpreter mode on CPU (TRITON_INTERPRET=1,
set in tests/conftest.py) or on CUDA when present. Shapes stay tiny: the interpreter is slow."""

import pytest
import torch
import torch.nn.functional as F

import vae_service.fastpath.kernels.group_norm as gn_kernel
from vae_service.fastpath.fused_norms import GroupNormSiLU, WanRMSNormSiLU
from vae_service.fastpath.kernels.rms_norm import rms_norm_silu
from vae_service.fastpath.kernels.support import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def channels_last(x):
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def assert_matches_reference(out, ref_fp32, dtype):
    """Kernel output in `dtype` vs the fp32 reference rounded to `dtype` (torch's per-dtype tolerances)."""
    assert out.dtype == dtype and out.shape == ref_fp32.shape
    torch.testing.assert_close(
        out, ref_fp32.to(dtype), **({"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {})
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n, c, groups, h, w", [(1, 32, 8, 4, 4), (2, 24, 6, 3, 5), (3, 12, 4, 1, 1), (1, 20, 5, 7, 2), (2, 8, 8, 2, 3)]
)
@pytest.mark.parametrize("silu", [True, False])
def test_group_norm_kernel(dtype, n, c, groups, h, w, silu):
    g = torch.Generator().manual_seed(n * c * h * w)
    x = channels_last((torch.randn(n, c, h, w, generator=g) * 2 + 0.5).to(dtype)).to(DEVICE)
    weight = torch.randn(c, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(c, generator=g).to(dtype).to(DEVICE)
    out = gn_kernel.group_norm_silu_channels_last(x, groups, weight, bias, 1e-6, silu)
    ref = F.group_norm(x.float(), groups, weight.float(), bias.float(), 1e-6)
    ref = F.silu(ref) if silu else ref
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_matches_reference(out, ref, dtype)


def test_group_norm_kernel_merges_chunks_stably(monkeypatch):
    """Many chunks and sub-blocks (tiny tiles forced), and a large mean: Chan's merge must hold."""
    monkeypatch.setattr(gn_kernel, "_TILE_ELEMS", 4)
    monkeypatch.setattr(gn_kernel, "_MAX_CHUNKS", 3)
    g = torch.Generator().manual_seed(0)
    x = channels_last(torch.randn(2, 8, 5, 7, generator=g) * 0.01 + 300.0).to(DEVICE)
    weight, bias = torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    out = gn_kernel.group_norm_silu_channels_last(x, 4, weight, bias, 1e-6, silu=False)
    exact = F.group_norm(x.double(), 4, weight.double(), bias.double(), 1e-6)
    torch_err = (F.group_norm(x, 4, weight, bias, 1e-6).double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    # both apply x * scale + shift in fp32 (error ~ulp(x * scale)); a naive E[x^2] - E[x]^2
    # variance in fp32 would be off by O(1) here
    assert err < 2 * torch_err + 1e-3, (err, torch_err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 12, 3, 5, 4), (2, 16, 1, 2, 3), (1, 20, 2, 1, 1), (2, 24, 3, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "frames_outer"])
def test_rms_norm_silu_kernel(dtype, shape, with_bias, layout):
    g = torch.Generator().manual_seed(sum(shape))
    c = shape[1]
    x = torch.randn(shape, generator=g).to(dtype)
    if layout == "channels_last":
        x = channels_last(x)
    elif layout == "frames_outer" and x.dim() == 5:  # [N, T, C, H, W] in memory, as Wan's resampler leaves it
        x = x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    x = x.to(DEVICE)
    param_shape = (c,) + (1,) * (len(shape) - 2)
    gamma = torch.randn(param_shape, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(param_shape, generator=g).to(dtype).to(DEVICE) if with_bias else 0.0
    out = rms_norm_silu(x, gamma, bias, c**0.5)
    assert out.stride() == x.stride()
    ref = F.silu(F.normalize(x.float(), dim=1) * c**0.5 * gamma.float() + (bias.float() if with_bias else 0.0))
    assert_matches_reference(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 12, 1, 5, 4), (2, 16, 4, 3, 3)])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_rms_norm_silu_kernel_epilogues(dtype, shape, layout):
    """The Wan walk's epilogues: the preceding conv's bias added in the kernel, and the result
    written into a causal conv's input buffer after its two history frames (a strided view)."""
    g = torch.Generator().manual_seed(sum(shape))
    n, c, t, h, w = shape
    x = torch.randn(shape, generator=g).to(dtype)
    fmt = torch.channels_last_3d if layout == "channels_last" else torch.contiguous_format
    x = x.contiguous(memory_format=fmt).to(DEVICE)
    gamma = torch.randn(c, 1, 1, 1, generator=g).to(dtype).to(DEVICE)
    in_bias = torch.randn(c, generator=g).to(dtype).to(DEVICE)
    buf = torch.full((n, c, 2 + t, h, w), 7.0, dtype=dtype).contiguous(memory_format=fmt).to(DEVICE)
    out = rms_norm_silu(x, gamma, 0.0, c**0.5, in_bias=in_bias, out=buf[:, :, 2:])
    assert out is not None and out.data_ptr() == buf[:, :, 2:].data_ptr()
    assert bool((buf[:, :, :2] == 7.0).all())  # the history frames are left alone
    biased = (x + in_bias.view(1, -1, 1, 1, 1)).float()  # rounded to the activation dtype first, as torch
    ref = F.silu(F.normalize(biased, dim=1) * c**0.5 * gamma.float())
    assert_matches_reference(buf[:, :, 2:], ref, dtype)
    norm = _rms_module(gamma)
    native = WanRMSNormSiLU.forward_native(x, norm, in_bias=in_bias)
    assert torch.equal(native, WanRMSNormSiLU.forward_native(x + in_bias.view(1, -1, 1, 1, 1), norm))


def _rms_module(gamma):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    norm = WanRMS_norm(gamma.shape[0], images=False).to(gamma.device, gamma.dtype)
    with torch.no_grad():
        norm.gamma.copy_(gamma)
    return norm


def test_kernels_refuse_what_they_do_not_support():
    x = torch.randn(1, 8, 4, 4, device=DEVICE)
    w, b = torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    assert gn_kernel.group_norm_silu_channels_last(x, 4, w, b, 1e-6) is None  # NCHW, not channels-last
    xc = channels_last(x)
    assert gn_kernel.group_norm_silu_channels_last(xc, 3, w, b, 1e-6) is None  # groups do not divide C
    assert gn_kernel.group_norm_silu_channels_last(xc, 4, None, None, 1e-6) is None  # no affine
    assert gn_kernel.group_norm_silu_channels_last(xc.to(torch.float64), 4, w, b, 1e-6) is None
    assert rms_norm_silu(x.transpose(2, 3), w, 0.0, 8**0.5) is None  # neither layout
    assert rms_norm_silu(xc, w, 0.5, 8**0.5) is None  # non-zero scalar bias


def test_a_bound_triton_op_never_launches_while_torch_compile_traces(monkeypatch):
    launched = []
    monkeypatch.setattr(GroupNormSiLU, "forward_triton", staticmethod(lambda *a, **k: launched.append(1)))
    op = GroupNormSiLU.bind("triton")
    norm = torch.nn.GroupNorm(4, 8).to(DEVICE)
    x = channels_last(torch.randn(1, 8, 2, 2)).to(DEVICE)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        assert torch.equal(op(x, norm), GroupNormSiLU.forward_native(x, norm))
    assert launched == []
    with pytest.raises(ValueError, match="unknown norm backend"):
        GroupNormSiLU.bind("cuda")


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU check: without the interpreter the kernels step aside")
def test_kernels_step_aside_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    xc = channels_last(torch.randn(1, 8, 2, 2))
    assert gn_kernel.group_norm_silu_channels_last(xc, 4, torch.ones(8), torch.zeros(8), 1e-6) is None


def test_fused_ops_triton_and_native_agree():
    g = torch.Generator().manual_seed(5)
    norm = torch.nn.GroupNorm(4, 16).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_(generator=None), norm.bias.normal_()
    x = channels_last(torch.randn(2, 16, 3, 6, generator=g)).to(DEVICE)
    torch.testing.assert_close(
        GroupNormSiLU.forward_triton(x, norm, True),
        GroupNormSiLU.forward_native(x.clone(), norm, True),
        atol=2e-5,
        rtol=2e-5,
    )

    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    rms = WanRMS_norm(16, images=False).to(DEVICE)
    with torch.no_grad():
        rms.gamma.normal_()
    x5 = channels_last(torch.randn(1, 16, 2, 3, 4, generator=g)).to(DEVICE)
    torch.testing.assert_close(
        WanRMSNormSiLU.forward_triton(x5, rms), WanRMSNormSiLU.forward_native(x5, rms), atol=2e-5, rtol=2e-5
    )
    # the native op is exactly diffusers' norm followed by SiLU
    assert torch.equal(WanRMSNormSiLU.forward_native(x5, rms), F.silu(rms(x5)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_kernel_folds_an_input_bias(dtype):
    g = torch.Generator().manual_seed(9)
    x = channels_last(torch.randn(2, 16, 3, 5, generator=g).to(dtype)).to(DEVICE)
    in_bias = torch.randn(16, generator=g).to(dtype).to(DEVICE)
    weight, bias = torch.randn(16, generator=g).to(DEVICE), torch.randn(16, generator=g).to(DEVICE)
    out = gn_kernel.group_norm_silu_channels_last(x, 4, weight.to(dtype), bias.to(dtype), 1e-6, True, in_bias)
    shifted = x.float() + in_bias.float().view(1, -1, 1, 1)
    ref = F.silu(F.group_norm(shifted, 4, weight.to(dtype).float(), bias.to(dtype).float(), 1e-6))
    assert_matches_reference(out, ref, dtype)
    native = GroupNormSiLU.forward_native(
        x.float(), _norm(weight.to(dtype).float(), bias.to(dtype).float()), True, in_bias.float()
    )
    torch.testing.assert_close(native, ref, atol=2e-5, rtol=2e-5)


def _norm(weight, bias):
    norm = torch.nn.GroupNorm(4, weight.numel()).to(weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight), norm.bias.copy_(bias)
    return norm
