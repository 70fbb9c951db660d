"""Every CPU YAML in deploy/ starts the way a user starts it (`serve run FILE`, which brings up its
own local Ray with the default resources: this machine's 2 CPUs), answers /health, decodes one
request through every model it serves, and shuts down on Ctrl-C. GPU YAMLs are checked
structurally in test_deploy_configs.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.integration.conftest import free_port
from vae_service_client import VaeClient

pytestmark = pytest.mark.integration
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CPU_YAMLS = sorted(
    p.name
    for p in DEPLOY.glob("*.yaml")
    if "num_gpus" not in p.read_text() and yaml.safe_load(p.read_text()).get("applications")
)


def test_every_cpu_yaml_is_covered():
    assert {"serve-cpu.yaml", "serve-multi.yaml"} <= set(CPU_YAMLS)


def _on_free_ports(name: str, folder: Path) -> tuple[Path, int]:
    """The YAML as shipped, but on free ports (the session's own Serve holds others)."""
    raw = yaml.safe_load((DEPLOY / name).read_text())
    port = free_port()
    raw["http_options"]["port"] = port
    raw["grpc_options"]["port"] = free_port()
    path = folder / name
    path.write_text(yaml.safe_dump(raw))
    return path, port


def _models(health: dict) -> dict[str, dict]:
    return health["models"] if "models" in health else {health["model"]: health}


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> dict:
    end = time.time() + timeout_s
    while time.time() < end:
        assert proc.poll() is None, f"serve run exited with {proc.returncode}"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # nothing to await: `serve run` says nothing when it is up
    raise AssertionError(f"{url}/health never answered")


@pytest.mark.parametrize("name", CPU_YAMLS)
def test_cpu_yaml_starts_answers_and_stops_on_two_cpus(name, tmp_path):
    path, port = _on_free_ports(name, tmp_path)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)  # a new local cluster with Ray's default resources, as for a user
    serve = Path(sys.executable).with_name("serve")
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [str(serve), "run", str(path)], cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        models = _models(_wait_healthy(url, proc))
        assert models
        with VaeClient(url, timeout=300) as client:
            for model, info in models.items():
                shape = (1, info["latent_channels"]) + ((1,) if info["family"] == "video" else ()) + (4, 6)
                z = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
                resp = client.decode(z, model=model)
                expected = (1, 1, 32, 48, 3) if info["family"] == "video" else (1, 32, 48, 3)
                assert (resp.model, resp.output.shape, resp.output.dtype) == (model, expected, np.uint8)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: serve run shuts down Serve and the Ray it started
        try:
            proc.wait(timeout=120)
            stopped_on_ctrl_c = True
        except subprocess.TimeoutExpired:
            stopped_on_ctrl_c = False
            os.killpg(proc.pid, signal.SIGKILL)  # only the process group this test started
            proc.wait()
        log.close()
    assert stopped_on_ctrl_c, "serve run was still running 120 s after Ctrl-C"
    deadline = time.monotonic() + 30  # and the HTTP proxy goes with it
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            break
        assert time.monotonic() < deadline, f"{url} still answers after serve run stopped"
        time.sleep(0.1)
