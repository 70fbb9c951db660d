"""The fast path's rules: lossless untouched, high within its documented bound, install rules,
gate, folded-buffer lifecycle."""

import copy
import math

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D
from torch import nn

from tests.models import build_full_vae
from vae_service.engine.runtime.wan_walk import walk_chunks, walk_options
from vae_service.fastpath import install_fast_path
from vae_service.fastpath.fused_norms import GroupNormSiLU, WanRMSNormSiLU
from vae_service.fastpath.gate import FastPathGate
from vae_service.fastpath.kernels.support import interpreting
from vae_service.fastpath.patching import Patch
from vae_service.fastpath.rewrites import REWRITES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Documented bounds of `high` (docs/fast-path.md, "Error bounds"). fp32: against lossless, on the [-1, 1]
# float output and the uint8 image. bf16: bf16 rounding dominates both tiers, so `high` is
# bounded by lossless' own error, both measured against the fp32 decode.
FP32_MAX_ABS = 1e-3
MIN_PSNR_DB = {torch.float32: 50.0, torch.bfloat16: 35.0}
BF16_ERROR_RATIO = 2.0


def installed_copy(vae, dtype=torch.float32):
    fast = copy.deepcopy(vae).to(dtype)
    return fast, install_fast_path(fast)


def decode(vae, z, fast_path=None, high=False):
    """diffusers' decode; with `fast_path`, a tier as the engine runs it (Wan: the walk with the
    plan's options; image models: `vae.decode` with the gate)."""
    with torch.inference_mode():
        if fast_path is None:
            return vae.decode(z).sample
        if z.dim() == 5:
            options = walk_options(fast_path.plan)["high" if high else "lossless"]
            return torch.cat(list(walk_chunks(vae, z, options, fast_path.folded)), 2)
        with fast_path.gate.use(high):
            return vae.decode(z).sample


def psnr_uint8(a, b):
    qa, qb = [((x.float() / 2 + 0.5).clamp(0, 1) * 255).round() for x in (a, b)]
    mse = (qa - qb).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def latents_for(kind, shape_hw, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "wan":
        return torch.randn(batch, 4, 2, *shape_hw, generator=g)
    return torch.randn(batch, 8 if kind == "flux" else 4, *shape_hw, generator=g)


@pytest.mark.parametrize("kind", ["kl", "flux", "wan", "kl64"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lossless_after_install_is_bit_identical_to_before(kind, precision):
    dtype = DTYPES[precision]
    vae = build_full_vae(kind).to(dtype)
    fast, fp = installed_copy(vae, dtype)
    assert fp.installed, fp.skipped_because
    z = latents_for(kind, (5, 3), seed=1).to(dtype)
    before = decode(vae, z)
    decode(fast, z, fp, high=True)  # folded buffers now exist; lossless must not see them
    assert torch.equal(decode(fast, z, fp, high=False), before)
    assert torch.equal(decode(fast, z), before)  # gate off by default


@pytest.mark.parametrize("kind", ["kl", "flux", "wan", "kl64"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("seed, hw, batch", [(0, (4, 4), 1), (1, (5, 7), 2), (2, (3, 1), 1), (3, (9, 4), 1)])
def test_high_is_within_the_documented_bound(kind, precision, seed, hw, batch):
    dtype = DTYPES[precision]
    vae = build_full_vae(kind)
    fast, fp = installed_copy(vae, dtype)
    z = latents_for(kind, hw, seed, batch)
    lossless = decode(fast, z.to(dtype), fp, high=False)
    high = decode(fast, z.to(dtype), fp, high=True)
    assert high.shape == lossless.shape and high.dtype == lossless.dtype
    assert (
        high.is_contiguous() or kind == "wan"
    )  # the walk's chunks are copied into the answer (engine/execution/video.py)
    assert psnr_uint8(high, lossless) >= MIN_PSNR_DB[dtype]
    if dtype == torch.float32:
        assert (high - lossless).abs().max().item() <= FP32_MAX_ABS
    else:
        exact = decode(vae, z)
        high_err = (high.float() - exact).abs().max().item()
        lossless_err = (lossless.float() - exact).abs().max().item()
        assert high_err <= BF16_ERROR_RATIO * lossless_err, (high_err, lossless_err)


def test_install_is_idempotent_and_keeps_parameter_names():
    vae = build_full_vae("kl")
    state = copy.deepcopy(vae.state_dict())
    first = install_fast_path(vae)
    forwards = {name: m.__dict__.get("forward") for name, m in vae.named_modules()}
    assert install_fast_path(vae) is first
    assert {name: m.__dict__.get("forward") for name, m in vae.named_modules()} == forwards  # not re-wrapped
    assert list(vae.state_dict()) == list(state)
    vae.load_state_dict(state, strict=True)


class CustomResnet(ResnetBlock2D):
    pass


def _swap_first_resnet(vae, make):
    block = vae.decoder.up_blocks[0]
    old = block.resnets[0]
    block.resnets[0] = make(old)
    return vae


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (
            lambda v: _swap_first_resnet(
                v,
                lambda old: CustomResnet(
                    in_channels=old.in_channels, out_channels=old.out_channels, temb_channels=None, groups=8
                ),
            ),
            "CustomResnet",
        ),
        (lambda v: setattr(v.decoder.mid_block.attentions[0], "heads", 2) or v, "heads 2"),
        (
            lambda v: setattr(v.decoder.up_blocks[1].resnets[0], "nonlinearity", nn.SiLU(inplace=True)) or v,
            "up_blocks.1.resnets.0",
        ),
        (lambda v: setattr(v.decoder, "conv_act", nn.ReLU()) or v, "output head"),
    ],
)
def test_unsupported_structures_are_skipped_and_high_still_decodes(mutate, reason, caplog):
    vae = mutate(build_full_vae("kl"))
    fp = install_fast_path(vae)
    assert not fp.installed
    assert any(reason in r for r in fp.skipped_because), fp.skipped_because
    assert reason.split()[0] in caplog.text
    assert all("forward" not in m.__dict__ for m in vae.modules())
    z = latents_for("kl", (3, 3), seed=0)
    assert torch.equal(decode(vae, z, fp, high=True), decode(vae, z))


def test_wan_with_inplace_silu_is_skipped():
    vae = build_full_vae("wan")
    vae.decoder.up_blocks[0].resnets[0].nonlinearity = nn.SiLU(inplace=True)
    fp = install_fast_path(vae)
    assert not fp.installed and "residual block" in fp.skipped_because[0]


def test_a_failing_install_leaves_the_reference_path(monkeypatch):
    vae = build_full_vae("kl")
    z = latents_for("kl", (4, 4), seed=0)
    before = decode(vae, z)
    calls = []
    original = Patch.apply

    def flaky(self, gate):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected")
        original(self, gate)

    monkeypatch.setattr(Patch, "apply", flaky)
    fp = install_fast_path(vae)
    assert not fp.installed and "injected" in fp.skipped_because[0]
    assert all("forward" not in m.__dict__ for m in vae.modules())
    assert torch.equal(decode(vae, z, fp, high=True), before)


def test_gate_restores_previous_state_on_exit_and_exception():
    gate = FastPathGate()
    with gate.use(True):
        assert gate.enabled
        with gate.use(False):
            assert not gate.enabled
        assert gate.enabled
        with pytest.raises(ValueError), gate.use(False):
            raise ValueError
        assert gate.enabled
    assert not gate.enabled


@pytest.mark.parametrize("kind", ["kl", "kl64"])
def test_folded_buffers_are_lazy_released_and_rebuilt(kind):
    fast, fp = installed_copy(build_full_vae(kind))
    z = latents_for(kind, (4, 5), seed=2)
    assert fp.folded.nbytes == 0  # nothing folded before the first high decode
    decode(fast, z, fp, high=False)
    assert fp.folded.nbytes == 0
    first = decode(fast, z, fp, high=True)
    held = fp.folded.nbytes
    assert held > 0 and len(fp.folded) > 0
    assert fp.release() == held
    assert fp.folded.nbytes == 0 and len(fp.folded) == 0
    assert torch.equal(decode(fast, z, fp, high=True), first)
    assert fp.folded.nbytes == held


def test_folded_buffers_follow_a_dtype_change():
    fast, fp = installed_copy(build_full_vae("kl"))
    z = latents_for("kl", (4, 4), seed=3)
    decode(fast, z, fp, high=True)
    fast.to(torch.bfloat16)
    decode(fast, z.to(torch.bfloat16), fp, high=True)
    dtypes = {k[3] for k in fp.folded._tensors}
    assert dtypes == {torch.bfloat16}  # the fp32 folds were dropped, not kept alongside


def test_wide_model_runs_winograd_on_cpu():
    fast, fp = installed_copy(build_full_vae("kl64"))
    decode(fast, latents_for("kl64", (4, 4), seed=0), fp, high=True)
    assert any(name.endswith(".conv1") for name in fp.folded.names("winograd"))


IMAGE_REWRITES = [n for n, r in REWRITES.items() if r.family == "image"]


@pytest.mark.parametrize("disabled", [[name] for name in IMAGE_REWRITES] + [["winograd", "upsample_fold"]])
def test_each_rewrite_can_be_disabled_and_high_stays_within_its_bound(disabled):
    vae = build_full_vae("kl64")
    fast = copy.deepcopy(vae)
    fp = install_fast_path(fast, disabled=tuple(disabled))
    z = latents_for("kl64", (5, 3), seed=4)
    high = decode(fast, z, fp, high=True)
    assert (high - decode(vae, z)).abs().max().item() <= FP32_MAX_ABS
    described = fp.describe()
    for name in disabled:
        assert name not in described["rewrites"] and "disabled by config" in described["not_applied"][name]
        assert fp.folded.names(name) == []  # a disabled rewrite folds nothing
    assert sum(r["folded_bytes"] for r in described["rewrites"].values()) == fp.folded.nbytes > 0


def test_health_lists_the_folded_bytes_of_each_rewrite():
    fast, fp = installed_copy(build_full_vae("kl64"))
    decode(fast, latents_for("kl64", (4, 4), seed=0), fp, high=True)
    rewrites = fp.describe()["rewrites"]
    assert rewrites["winograd"]["folded_bytes"] > rewrites["attention_fold"]["folded_bytes"] > 0
    assert rewrites["upsample_fold"]["folded_bytes"] > 0 and rewrites["channels_last"]["folded_bytes"] == 0
    assert set(rewrites) == {
        "channels_last",
        "group_norm_silu",
        "upsample_fold",
        "attention_fold",
        "winograd",
        "inplace_resnet",
    }
    assert rewrites["inplace_resnet"]["tiers"] == ["lossless", "high"] and rewrites["winograd"]["tiers"] == ["high"]


def test_disabling_every_rewrite_installs_nothing():
    vae = build_full_vae("wan")
    fp = install_fast_path(vae, disabled=tuple(n for n, r in REWRITES.items() if r.family == "video"))
    assert not fp.installed and "every rewrite" in fp.skipped_because[0]
    assert all("forward" not in m.__dict__ for m in vae.modules())


@pytest.mark.skipif(not interpreting(), reason="runs the Triton kernels on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["kl", "wan"])
def test_triton_backend_bound_at_install_runs_the_kernels(kind, monkeypatch):
    """The backend a rewrite binds at install is what runs: forced to Triton (interpreted), every
    fused norm launches a kernel, conv1's bias rides into norm2's, and high keeps its bound."""
    op = GroupNormSiLU if kind == "kl" else WanRMSNormSiLU
    launched, calls, original = [], [], op.forward_triton

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        launched.append(out is not None)
        calls.append(kwargs)
        return out

    monkeypatch.setattr(op, "forward_triton", staticmethod(counting))
    vae = build_full_vae(kind)
    fast = copy.deepcopy(vae)
    fp = install_fast_path(fast, norm_backend="triton")
    assert fp.describe()["rewrites"]["group_norm_silu" if kind == "kl" else "rms_norm_silu"]["backend"] == "triton"
    assert ("conv_bias_fold" in fp.plan) is (kind == "kl")
    assert ("wan_conv_bias_fold" in fp.plan) is (kind == "wan")
    z = latents_for(kind, (3, 2), seed=5)
    high = decode(fast, z, fp, high=True)
    assert launched and all(launched)
    assert (high - decode(vae, z)).abs().max().item() <= FP32_MAX_ABS
    if kind == "wan":  # the walk's norms write into the conv buffers, conv1's bias folded into norm2's
        assert all(k["out"] is not None for k in calls) and any(k["in_bias"] is not None for k in calls)
