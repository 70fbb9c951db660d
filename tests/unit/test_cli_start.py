"""What the CLI loads before it answers: every --help, `decode` (a client of the service) and
`serve`'s refusals start without torch, Ray or diffusers (seconds each on a small CPU), and the
names they show instead of importing the tables (vae_service/names.py) are the tables' own.
`batch-decode` says what its job does, not Ray's start-up chatter."""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.ports import free_port
from vae_service import names

HEAVY = ("torch", "ray", "diffusers")
# runs the console script's main as `vae-service ARGV...` does, then prints the heavy packages it loaded
PROBE = """
import json, runpy, sys
sys.argv = ["vae-service", *sys.argv[1:]]
try:
    runpy.run_module("vae_service.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print("PROBE " + json.dumps({"code": code, "loaded": loaded}))
""" % (HEAVY,)  # noqa: UP031 (the braces of the script)


def probe(*argv: str) -> tuple[dict, str]:
    """Runs `vae-service ARGV` in a new interpreter -> ({code, loaded}, stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, env=_no_cluster_env()
    )
    line = next(ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE ")), done.stderr


def _no_cluster_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    return {**env, "RAY_ADDRESS": "local"}  # should anything start Ray, its own cluster, not a test session's


def test_the_names_without_torch_are_the_tables_names():
    from vae_service.fastpath import rewrites
    from vae_service.models.presets import PRESETS

    assert tuple(PRESETS) == names.PRESET_NAMES  # in the catalog's order: `serve --help` lists them so
    assert rewrites.REWRITE_NAMES == names.REWRITE_NAMES
    assert rewrites.RETIRED_REWRITES == names.RETIRED_REWRITES


@pytest.mark.parametrize("command", [[], ["serve"], ["decode"], ["batch-decode"], ["bench"], ["guard-env"]])
def test_help_loads_no_torch_ray_or_diffusers(command):
    result, _ = probe(*command, "--help")
    assert result == {"code": 0, "loaded": []}


@pytest.fixture
def nothing_listens() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _npy(path, dtype=np.float32):
    np.save(path, np.zeros((1, 4, 8, 8), dtype))
    return str(path)


def _safetensors(path):
    from safetensors.numpy import save_file

    save_file({"latents": np.zeros((1, 4, 8, 8), np.float16)}, str(path))
    return str(path)


@pytest.mark.parametrize(
    "source",
    [
        lambda tmp: [_npy(tmp / "z.npy")],
        lambda tmp: [_npy(tmp / "f64.npy", np.float64)],
        lambda tmp: [_safetensors(tmp / "z.safetensors")],
        lambda tmp: ["--random-latents", "1x4x8x8"],
    ],
    ids=["npy", "float64-npy", "safetensors", "random-latents"],
)
def test_decode_loads_no_torch_ray_or_diffusers(tmp_path, nothing_listens, source):
    """It reads the latents and sends them; nothing listens at the URL, so it stops there."""
    result, err = probe("decode", *source(tmp_path), "--url", nothing_listens, "--out", str(tmp_path / "out"))
    assert result == {"code": 1, "loaded": []}
    assert "connection refused (nothing listening)" in err.strip().splitlines()[-1]


def _held_port():
    held = socket.socket()
    held.bind(("127.0.0.1", free_port()))
    held.listen()
    return held


@pytest.mark.parametrize(
    "argv, code, text",
    [
        (["--model", "tiny-k1"], 2, "did you mean 'tiny-kl'"),
        (["--config", "{tmp}/bad.yaml"], 2, "limts: unknown field; did you mean 'limits'?"),
        (["--config", "{tmp}/missing.yaml"], 2, "--config {tmp}/missing.yaml: "),
        (["--model", "tiny-kl", "--port", "{held}"], 1, "port {held} (HTTP) on 127.0.0.1 is not free"),
    ],
    ids=["model-typo", "unknown-field", "unreadable-config", "port-in-use"],
)
def test_serve_refuses_before_loading_torch_ray_or_diffusers(tmp_path, argv, code, text):
    (tmp_path / "bad.yaml").write_text("limts: {max_batch_items: 3}\n")
    with _held_port() as held:
        port = held.getsockname()[1]
        fill = {"tmp": tmp_path, "held": port}
        argv = [a.format(**fill) for a in argv]
        if "--port" not in argv:
            argv += ["--port", str(free_port())]
        result, err = probe("serve", *argv, "--grpc-port", "0")
    assert result == {"code": code, "loaded": []}
    lines = err.strip().splitlines()
    assert len(lines) == 1 and text.format(**fill) in lines[0], lines


# Ray's lines at start-up and around a dataset that mean nothing to the job's user
RAY_CHATTER = ("Token authentication is enabled", "Progress bars disabled", "Starting execution of Dataset",
               "Execution plan of Dataset", "execution finished")  # fmt: skip


def test_batch_decode_says_what_the_job_does_not_rays_chatter(tmp_path):
    """Its own local cluster (RAY_ADDRESS=local), Ray's default token auth (no RAY_AUTH_MODE) and
    its token under this test's HOME; the job's progress and summary, and nothing of Ray's at INFO."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name, seed in (("a", 0), ("b", 1)):
        np.save(inputs / f"{name}.npy", np.random.default_rng(seed).standard_normal((1, 4, 8, 8), dtype=np.float32))
    cli = [sys.executable, "-m", "vae_service.cli"]
    done = subprocess.run(
        [*cli, "batch-decode", "--model", "tiny-kl", str(inputs), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**_no_cluster_env(), "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert "2 of 2 inputs in " in done.stdout and "2 decoded" in done.stdout
    assert "[2/2 inputs] 2 decoded" in done.stderr  # the job's progress
    said = done.stdout + done.stderr
    assert [c for c in RAY_CHATTER if c in said] == []
    assert not re.search(r"\tINFO \S+\.py:\d+ -- ", said), said
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.png", "b.png"]
