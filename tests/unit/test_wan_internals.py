"""The diffusers internals the Wan walk reads (models/wan_internals.py): every architecture the tests
decode passes the checks, and each internal, changed as a diffusers release could change it, is
caught by name, so such a model decodes through diffusers' own forward instead of a wrong walk."""

import inspect

import pytest
import torch
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
from diffusers.models.autoencoders import autoencoder_kl_wan as wan_module

from tests.unit.test_video_decode import ALL_CONFIGS, wan
from vae_service.fastpath.rewrites import REWRITES, plan_rewrites
from vae_service.models.wan_internals import walk_unsupported_because


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_every_tested_architecture_passes_the_walks_checks(config):
    assert walk_unsupported_because(wan(config)) == []


def first(vae, type_name: str):
    return next(m for m in vae.decoder.modules() if type(m).__name__ == type_name)


def history_of_three(monkeypatch, vae):
    monkeypatch.setattr(wan_module, "CACHE_T", 3)
    monkeypatch.setattr(qwen, "CACHE_T", 3)


def padding_both_sides(monkeypatch, vae):
    conv = vae.decoder.conv_in
    conv._padding = (*conv._padding[:4], 1, 1)


def padding_renamed(monkeypatch, vae):
    del vae.decoder.up_blocks[0].resnets[0].conv1._padding


def strided_in_time(monkeypatch, vae):
    vae.decoder.conv_out.stride = (2, *vae.decoder.conv_out.stride[1:])


def shortcut_without_first_chunk(monkeypatch, vae):
    forward = wan_module.DupUp3D.forward
    monkeypatch.setattr(wan_module.DupUp3D, "forward", lambda self, x: forward(self, x, False))


def unknown_resample_mode(monkeypatch, vae):
    first(vae, "WanResample" if type(vae).__name__.endswith("Wan") else "QwenImageResample").mode = "upsample4d"


def norm_not_channel_first(monkeypatch, vae):
    vae.decoder.norm_out.channel_first = False


def attribute_renamed(monkeypatch, vae):
    del vae.decoder.norm_out.channel_first


def a_module_it_does_not_know(monkeypatch, vae):
    vae.decoder.mid_block.resnets[0].norm1 = torch.nn.GroupNorm(
        1, vae.decoder.mid_block.resnets[0].norm1.gamma.shape[0]
    )


@pytest.mark.parametrize(
    "config, change, reason",
    [
        ("tiny", history_of_three, "caches 3 frames"),
        ("qwen-image", history_of_three, "caches 3 frames"),
        ("tiny", padding_both_sides, "causal conv conv_in"),
        ("wan2.2", padding_renamed, "up_blocks.0.resnets.0.conv1"),
        ("no-time", strided_in_time, "causal conv conv_out"),
        ("wan2.2", shortcut_without_first_chunk, "takes no first_chunk"),
        ("tiny", unknown_resample_mode, "resamples by 'upsample4d'"),
        ("qwen-image", unknown_resample_mode, "resamples by 'upsample4d'"),
        ("wide", norm_not_channel_first, "output head"),
        ("wan2.2", attribute_renamed, "AttributeError"),
        ("qwen-image-attn", a_module_it_does_not_know, "unknown module mid_block.resnets.0.norm1"),
    ],
)
def test_each_internal_the_walk_reads_is_checked(monkeypatch, config, change, reason):
    vae = wan(config)
    change(monkeypatch, vae)
    reasons = walk_unsupported_because(vae)
    assert any(reason in r for r in reasons), reasons


def test_the_shortcut_check_reads_the_real_signature():
    assert "first_chunk" in inspect.signature(wan_module.DupUp3D.forward).parameters


@pytest.mark.parametrize("family", ["image", "video"])
def test_rewrites_list_what_they_require_before_themselves(family):
    names = [n for n, r in REWRITES.items() if r.family == family]
    for name in names:
        for needed in REWRITES[name].requires:
            assert needed in names and names.index(needed) < names.index(name), (name, needed)


@pytest.mark.parametrize(
    "family, dependent, disabled, backend, why",
    [
        ("image", "conv_bias_fold", ("group_norm_silu",), "triton", "needs group_norm_silu"),
        ("image", "conv_bias_fold", (), "torch", "needs the Triton norm backend"),
        ("video", "wan_conv_bias_fold", ("rms_norm_silu",), "triton", "needs rms_norm_silu"),
        ("video", "wan_conv_bias_fold", (), "torch", "the Triton norm backend"),
        ("video", "rms_norm_silu", (), "torch", "needs the Triton norm backend"),
    ],
)
def test_a_rewrite_runs_only_with_what_it_requires(family, dependent, disabled, backend, why):
    plan = plan_rewrites(family, torch.device("cpu"), torch.float32, disabled, backend)
    assert dependent not in plan and why in plan.inactive[dependent]
    full = plan_rewrites(family, torch.device("cpu"), torch.float32, (), "triton")
    assert full.active[dependent] == "triton"
