"""`vae-service serve|bench --config FILE`: a ServiceConfig in YAML or JSON, flags on top."""

import argparse
import json

import pytest
import yaml

from vae_service.cli import _config_from


def args(**kw):
    return argparse.Namespace(**{"config": None, "model": None, "precision": None, "device": None, **kw})


@pytest.mark.parametrize("suffix, dump", [(".yaml", yaml.safe_dump), (".json", json.dumps)])
def test_config_file_sets_limits_batching_and_fast_path_and_flags_override(tmp_path, suffix, dump):
    data = {
        "model": "tiny-wan",
        "decode_precision": "bf16",
        "limits": {"max_batch_items": 3},
        "batching": {"max_batch_size": 2},
        "fast_path": {"disable": ["rms_norm_silu"]},
    }
    path = tmp_path / f"service{suffix}"
    path.write_text(dump(data))
    config = _config_from(args(config=str(path)))
    assert (config.model, config.decode_precision, config.limits.max_batch_items) == ("tiny-wan", "bf16", 3)
    assert config.batching.max_batch_size == 2 and config.fast_path.disable == ("rms_norm_silu",)
    overridden = _config_from(args(config=str(path), model="tiny-kl", precision="fp32"))
    assert (overridden.model, overridden.decode_precision, overridden.limits.max_batch_items) == ("tiny-kl", "fp32", 3)


def test_flags_alone_keep_the_defaults():
    config = _config_from(args(model="tiny-kl"))
    assert (config.model, config.decode_precision, config.device) == ("tiny-kl", "auto", "auto")


@pytest.mark.parametrize(
    "content, text",
    [
        ("limits: {max_batch_itemz: 3}", "max_batch_itemz"),
        ("decode_precision: fp64", "decode_precision"),
        ("- just a list", "must hold a map"),
        ("model: [unclosed", "--config"),
    ],
)
def test_a_bad_config_file_exits_naming_the_field(tmp_path, content, text):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        _config_from(args(config=str(path)))
    assert text in str(exc.value)
