"""Real CUDA checks (skipped without a GPU): lossless bit-identity, high's bound with the Triton
kernels in the loop, and folded-buffer memory going back to the allocator."""

import copy

import pytest
import torch

from tests.models import reference_decode
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.fastpath.fused_norms import GroupNormSiLU, WanRMSNormSiLU

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def engines(kl_dir, wan_dir):
    return {
        kind: DecodeEngine(ServiceConfig(model=str(folder), model_name=kind, device="cuda"))
        for kind, folder in (("kl", kl_dir), ("wan", wan_dir))
    }


def decode(engine, z, quality):
    request = DecodeRequest(z, quality=quality, output="float", scaling_factor=None)
    return engine.decode([engine.prepare(request)])[0].output


def test_auto_precision_is_bf16_on_cuda(engines):
    assert engines["kl"].precision == "bf16" and engines["kl"].device.type == "cuda"


@pytest.mark.parametrize("kind, shape", [("kl", (3, 4, 6, 5)), ("wan", (2, 4, 2, 4, 6))])
def test_lossless_is_bit_identical_to_diffusers_on_cuda(engines, kind, shape, kl_vae, wan_vae):
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    reference_vae = copy.deepcopy({"kl": kl_vae, "wan": wan_vae}[kind]).to("cuda", torch.bfloat16)
    expected = reference_decode(reference_vae, z.to("cuda", torch.bfloat16)).cpu()
    assert torch.equal(decode(engines[kind], z, "lossless"), expected)


@pytest.mark.parametrize("kind, shape", [("kl", (2, 4, 6, 5)), ("wan", (1, 4, 2, 4, 6))])
def test_high_uses_triton_and_stays_within_bound(kind, shape, kl_dir, wan_dir, kl_vae, wan_vae, monkeypatch):
    op = GroupNormSiLU if kind == "kl" else WanRMSNormSiLU
    launched, original = [], op.forward_triton

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        launched.append(out is not None)
        return out

    monkeypatch.setattr(op, "forward_triton", staticmethod(counting))  # before install: the backend binds then
    folder = {"kl": kl_dir, "wan": wan_dir}[kind]
    engine = DecodeEngine(ServiceConfig(model=str(folder), model_name=kind, device="cuda"))
    assert all(
        r["backend"] == "triton"
        for name, r in engine.describe()["fast_path"]["rewrites"].items()
        if name in ("group_norm_silu", "rms_norm_silu", "conv_bias_fold")
    )
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    high, lossless = decode(engine, z, "high"), decode(engine, z, "lossless")
    assert launched and all(launched)  # every fused norm ran as a kernel, none fell back
    fp32_vae = copy.deepcopy({"kl": kl_vae, "wan": wan_vae}[kind]).to("cuda")
    exact = reference_decode(fp32_vae, z.to("cuda")).cpu()
    high_err = (high.float() - exact).abs().max().item()
    lossless_err = (lossless.float() - exact).abs().max().item()
    assert high_err <= 2.0 * lossless_err, (high_err, lossless_err)


def test_release_returns_folded_memory_to_the_allocator(engines):
    engine = engines["kl"]
    decode(engine, torch.randn(1, 4, 4, 4), "high")
    held = engine.fast_path.folded.nbytes
    assert held > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert engine.release_folded() == held
    assert torch.cuda.memory_allocated() <= before - held
    decode(engine, torch.randn(1, 4, 4, 4), "high")
    assert engine.fast_path.folded.nbytes == held
