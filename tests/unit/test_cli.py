"""`vae-service serve|bench --config FILE`: a ServiceConfig in YAML or JSON, flags on top; what
`serve` refuses before Ray starts (a mistyped model or field, a port in use), in one line; the
generated preset list of --help; `guard-env`; what `decode` sends and how it names its files."""

import argparse
import json
import shlex
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import yaml

from tests.ports import free_port
from vae_service.cli import _config_from, main
from vae_service.config import ServiceConfig
from vae_service.models.presets import PRESETS
from vae_service.serving.wire.proxy_guard import proxy_guard_env


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
        "class": "AutoencoderKL", "family": "image", "weights": "random (decodes noise)", "precision": "fp32",
        "device": "cpu", "tiers": ["lossless", "high", "preview"],
        "geometry": {"min_latent_side": 1, "spatial_scale": 8, "latent_channels": 4},
    }  # fmt: skip
    off = banner("sd", health, "http://127.0.0.1:8000", 0, token=False).strip().splitlines()
    assert "SEEDED RANDOM WEIGHTS" in off[0] and "gRPC  off" in off[2]
    assert shlex.split(off[-1])[1:] == ["decode", "--url", "http://127.0.0.1:8000", "--random-latents", "1x4x16x16",
                                        "--out", "out"]  # fmt: skip
    on = banner("sd", health, "http://127.0.0.1:8000", 9000, token=False).strip().splitlines()
    assert "port 9000" in on[2] and "all interfaces" in on[2] and "no token" in on[2]
    assert max(len(line) for line in off + on) <= 140


def test_the_banner_of_a_video_model_suggests_video_latents():
    """Before: tiny-wan's banner suggested image latents (1x4x16x16), one frame, not a clip."""
    from vae_service.cli import banner

    health = {
        "class": "AutoencoderKLWan", "family": "video", "weights": "random (decodes noise)", "precision": "fp32",
        "device": "cpu", "tiers": ["lossless", "high", "preview"],
        "geometry": {"min_latent_side": 1, "spatial_scale": 8, "latent_channels": 4, "min_latent_frames": 1},
    }  # fmt: skip
    command = shlex.split(banner("tiny-wan", health, "http://127.0.0.1:8000", 0, token=False).strip().splitlines()[-1])
    assert command[command.index("--random-latents") + 1] == "1x4x3x16x16"


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


class FakeClient:
    """The VaeClient `decode` uses, answering as the service would without one: a file per item
    (one mp4 per streamed request), two frames per item streamed. `sent`: the latents it got."""

    sent: ClassVar[list] = []
    summary = SimpleNamespace(model="m", quality="lossless", precision="fp32", timing={})

    def __init__(self, url, token=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def decode(self, latents, quality, output, **options):
        self.sent.append(latents)
        return SimpleNamespace(output=[f"{output} {i}".encode() for i in range(len(latents))], **vars(self.summary))

    def decode_video(self, latents, path, quality, output="mp4"):
        self.sent.append(latents)
        Path(path).write_bytes(output.encode())
        return self.summary

    def decode_frames(self, latents, quality):
        self.sent.append(latents)
        return FakeStream(len(latents), self.summary)


class FakeStream(list):
    def __init__(self, items: int, summary):
        one = np.zeros((1, 2, 2, 2, 3), np.uint8)  # [items, frames, H, W, RGB]
        super().__init__(SimpleNamespace(pixels=one, frame_axis=1, item=i, frame=0) for i in range(items))
        self.summary = summary


@pytest.fixture
def fake_client(monkeypatch):
    import vae_service_client

    FakeClient.sent = []
    monkeypatch.setattr(vae_service_client, "VaeClient", FakeClient)
    return FakeClient


@pytest.mark.parametrize(
    "items, flags, names",
    [
        (1, [], ["z.png"]),
        (2, [], ["z-0.png", "z-1.png"]),
        (2, ["--format", "jpeg"], ["z-0.jpeg", "z-1.jpeg"]),
        (1, ["--video"], ["z.mp4"]),
        (2, ["--stream", "--video"], ["z.mp4"]),  # one streamed file for the request
        (1, ["--stream", "--format", "webm"], ["z.webm"]),  # a streamed WebM, named as the mp4 is
        (1, ["--stream", "--video", "--format", "webm"], ["z.webm"]),  # the container named wins over --video
        (1, ["--stream"], ["z-frame0000.png", "z-frame0001.png"]),
        (2, ["--stream"], ["z-0-frame0000.png", "z-0-frame0001.png", "z-1-frame0000.png", "z-1-frame0001.png"]),
    ],
)
def test_decode_names_its_outputs_after_the_input_as_batch_decode_does(fake_client, tmp_path, items, flags, names):
    np.save(tmp_path / "z.npy", np.zeros((items, 4, 8, 8), np.float32))
    main(["decode", str(tmp_path / "z.npy"), *flags, "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names


def test_random_latents_are_numpys_seeded_normals_named_random(fake_client, tmp_path):
    main(["decode", "--random-latents", "2x4x8x8", "--seed", "3", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["random-0.png", "random-1.png"]
    expected = np.random.default_rng(3).standard_normal((2, 4, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(fake_client.sent[0], expected)


def test_a_safetensors_file_is_sent_as_numpy_unless_it_holds_bfloat16(fake_client, tmp_path):
    """NumPy has no bfloat16: such latents come through torch, to go on the wire as bfloat16."""
    import torch
    from safetensors.torch import save_file

    save_file({"z": torch.zeros(1, 4, 8, 8, dtype=torch.float16)}, tmp_path / "half.safetensors")
    save_file({"z": torch.zeros(1, 4, 8, 8, dtype=torch.bfloat16)}, tmp_path / "brain.safetensors")
    for name in ("half", "brain"):
        main(["decode", str(tmp_path / f"{name}.safetensors"), "--out", str(tmp_path / "out")])
    half, brain = fake_client.sent
    assert isinstance(half, np.ndarray) and half.dtype == np.float16
    assert isinstance(brain, torch.Tensor) and brain.dtype == torch.bfloat16
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["brain.png", "half.png"]


def test_a_hidden_latents_file_is_refused_before_anything_is_sent(fake_client, tmp_path, capsys):
    np.save(tmp_path / ".z.npy", np.zeros((1, 4, 8, 8), np.float32))
    with pytest.raises(SystemExit) as exc:
        main(["decode", str(tmp_path / ".z.npy"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and fake_client.sent == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its name cannot name the output files" in err[0], err


@pytest.mark.parametrize(
    "output, said",
    [
        ("ftp://host/out", "scheme 'ftp' is not one of"),
        ("s3://bucket/out?access_key=x", "credentials never go in a URI"),
        ("s3://bucket/out?bogus=1", "unknown option 'bogus'"),
    ],
)
def test_batch_decode_refuses_an_output_no_store_reads_in_one_line_before_ray(tmp_path, capsys, output, said):
    np.save(tmp_path / "z.npy", np.zeros((1, 4, 8, 8), np.float32))
    with pytest.raises(SystemExit) as exit_:
        main(["batch-decode", str(tmp_path), output, "--model", "tiny-kl"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and said in err and "starting Ray" not in err


def test_decode_of_a_uri_no_store_reads_is_one_line(capsys):
    """Before: a LocationError traceback from reading the latents."""
    with pytest.raises(SystemExit) as exit_:
        main(["decode", "s3://bad!bucket/x.npy", "--url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1 and err.startswith("vae-service: s3://bad!bucket/x.npy")
