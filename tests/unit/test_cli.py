"""`vae-service serve|bench --config FILE`: a ServiceConfig in YAML or JSON, flags on top; what
`serve` refuses before Ray starts (a mistyped model or field, a port in use), in one line; the
generated preset list of --help; `guard-env`."""

import argparse
import json
import shlex
import socket

import numpy as np
import pytest
import yaml

from tests.ports import free_port
from vae_service.cli import _config_from, main
from vae_service.config import ServiceConfig
from vae_service.models.presets import PRESETS
from vae_service.serving.proxy_guard import proxy_guard_env


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
        ("limits: {max_batch_itemz: 3}", "limits.max_batch_itemz: unknown field; did you mean 'max_batch_items'?"),
        ("limts: {max_batch_items: 3}", "limts: unknown field; did you mean 'limits'?"),
        ("decode_precision: fp64", "decode_precision: 'fp64' is not one of auto, fp32, fp16, bf16; did you mean"),
        ("- just a list", "must hold a map"),
        ("model: [unclosed", "--config"),
    ],
)
def test_a_bad_config_file_exits_2_in_one_line_naming_the_field(tmp_path, capsys, content, text):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        _config_from(args(config=str(path)))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert text in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def no_ray(monkeypatch):
    """`serve` must refuse before Ray starts: starting it fails the test at once."""
    import ray

    def started(*a, **kw):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", started)


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--model", "tiny-k1"], "model: 'tiny-k1' is neither a preset, a local folder nor a hub id (org/name); "
                                 "did you mean 'tiny-kl'"),
        (["--model", "sdx1"], "did you mean 'sdxl'"),
        (["--precision", "fp33"], "decode_precision: 'fp33' is not one of auto, fp32, fp16, bf16; did you mean"),
        (["--device", "gpu"], "device: String should match pattern"),
    ],
)  # fmt: skip
def test_serve_refuses_a_mistyped_model_or_field_before_ray_starts(no_ray, capsys, argv, text):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv, "--port", str(free_port()), "--grpc-port", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err


def test_a_folder_without_a_served_vae_is_refused_before_ray_starts(no_ray, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path), "--port", str(free_port()), "--grpc-port", "0"])
    assert exc.value.code == 2
    assert "model: 'UNet2DConditionModel' is not a diffusers autoencoder" in capsys.readouterr().err


@pytest.mark.parametrize("reuse_port", [False, True])  # a plain listener, or another Serve's (SO_REUSEPORT)
@pytest.mark.parametrize("which", ["HTTP", "gRPC"])
def test_serve_refuses_a_port_in_use_in_one_line_naming_it(no_ray, capsys, which, reuse_port):
    held = socket.socket(socket.AF_INET6 if which == "gRPC" else socket.AF_INET)
    if reuse_port:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    port = free_port()
    held.bind(("::" if which == "gRPC" else "127.0.0.1", port))
    held.listen()
    http, grpc = (port, free_port()) if which == "HTTP" else (free_port(), port)
    try:
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", "tiny-kl", "--port", str(http), "--grpc-port", str(grpc)])
    finally:
        held.close()
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    flag = "--port" if which == "HTTP" else "--grpc-port"
    assert len(err) == 1 and f"port {port} ({which})" in err[0] and f"choose another with {flag} N" in err[0]


def test_help_lists_every_preset(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the list
    assert all(f"{name}," in shown or f"{name}:" in shown for name in PRESETS)


def test_the_banner_is_short_true_and_ends_with_the_command_to_try():
    from vae_service.cli import banner

    health = {
        "class": "AutoencoderKL", "weights": "random (decodes noise)", "precision": "fp32", "device": "cpu",
        "tiers": ["lossless", "high", "preview"],
        "geometry": {"min_latent_side": 1, "spatial_scale": 8, "latent_channels": 4},
    }  # fmt: skip
    off = banner("sd", health, "http://127.0.0.1:8000", 0, token=False).strip().splitlines()
    assert "SEEDED RANDOM WEIGHTS" in off[0] and "gRPC  off" in off[2]
    assert shlex.split(off[-1])[1:] == ["decode", "--url", "http://127.0.0.1:8000", "--random-latents", "1x4x16x16",
                                        "--out", "out"]  # fmt: skip
    on = banner("sd", health, "http://127.0.0.1:8000", 9000, token=False).strip().splitlines()
    assert "port 9000" in on[2] and "all interfaces" in on[2] and "no token" in on[2]
    assert max(len(line) for line in off + on) <= 140


def test_guard_env_prints_the_environment_of_a_yamls_applications(tmp_path, capsys):
    models = [{"model": "tiny-kl", "limits": {"max_request_bytes": 1000}}, {"model": "tiny-wan"}]
    path = tmp_path / "multi.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "vae", "import_path": "vae_service.serving.app:build_multi_app", "args": {"models": models}}
    ]}))  # fmt: skip
    main(["guard-env", str(path)])
    exports = dict(shlex.split(line)[1].split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert exports == proxy_guard_env([ServiceConfig(**m) for m in models])


@pytest.mark.parametrize(
    "content, text",
    [
        (lambda path: np.save(path, np.zeros((1, 4, 8, 8), np.int64)),
         "invalid_request (client-side, nothing sent): latents.dtype: int64 is not a latents dtype; send float32, "
         "float16, bfloat16"),
        (lambda path: path.write_bytes(b"not numpy at all"), "broken.npy: not a .npy file (no NumPy array header)"),
    ],
)  # fmt: skip
def test_decode_refuses_what_it_cannot_send_in_one_line_before_any_request(tmp_path, capsys, content, text):
    """Nothing listens at the URL: these are refused before a request would go out."""
    path = tmp_path / "broken.npy"
    content(path)
    with pytest.raises(SystemExit) as exc:
        main(["decode", str(path), "--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "out")])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vae-service: ") and text in err[0] and "uint8" not in err[0]
