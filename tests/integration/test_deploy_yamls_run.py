"""Every CPU YAML in deploy/ starts the way a user starts it (`serve run FILE`, which brings up its
own local Ray with the default resources: this machine's 2 CPUs), answers /health, decodes one
request through every model it serves, and shuts down on Ctrl-C. Started as its comments say
(`eval "$(vae-service guard-env FILE)"` first) its proxy keeps its ports to itself; started
without, a replica says the guard is missing (before: nothing did). GPU YAMLs are checked
structurally in test_deploy_configs.py.

The YAMLs' `serve run`s start together (one fixture for the module): each brings up its own Ray,
and much of that is waiting (Ray's processes, the controller, Serve's polls), so the second one's
start-up overlaps the first one's test instead of following it. Each test still checks its own
process from /health to Ctrl-C."""

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.integration.conftest import free_port
from vae_service.serving.scheduling.admission import ADMISSION_ENV
from vae_service.serving.wire.proxy_guard import CALLBACK_ENV
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


def _guard_env(path: Path) -> dict:
    """What `eval "$(vae-service guard-env FILE)"` exports, as the YAMLs' comments say to run it."""
    vae_service = Path(sys.executable).with_name("vae-service")
    printed = subprocess.run([str(vae_service), "guard-env", str(path)], capture_output=True, text=True, check=True)
    exports = [shlex.split(line) for line in printed.stdout.splitlines()]
    assert all(words[0] == "export" for words in exports)
    return dict(words[1].split("=", 1) for words in exports)


def _shares_a_port(*ports: int) -> bool:
    """Whether a listener of another Serve (SO_REUSEPORT) can bind one of these ports beside it."""
    for family, host, port in zip((socket.AF_INET, socket.AF_INET6), ("127.0.0.1", "::"), ports, strict=True):
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind((host, port))
                return True
            except OSError:
                pass
    return False


# serve-cpu.yaml started as its comments say; serve-multi.yaml as `serve run` alone
GUARDED = {"serve-cpu.yaml": True}


@dataclasses.dataclass
class Started:
    proc: subprocess.Popen
    path: Path  # the YAML it runs (on free ports)
    port: int
    log: Path  # its stdout and stderr
    guarded: bool


def _start(name: str, folder: Path) -> Started:
    path, port = _on_free_ports(name, folder)
    guarded = GUARDED.get(name, False)
    env = {k: v for k, v in os.environ.items() if k not in (CALLBACK_ENV, ADMISSION_ENV, "RAY_ADDRESS")}
    env.update(_guard_env(path) if guarded else {}, RAY_AUTH_MODE="disabled")  # a new local cluster, as a user's
    serve = Path(sys.executable).with_name("serve")
    log = folder / "serve.log"
    with log.open("w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [str(serve), "run", str(path)], cwd=folder, env=env, stdout=out, stderr=out, start_new_session=True
        )
    return Started(proc, path, port, log, guarded)


def _stop(proc: subprocess.Popen) -> bool:
    """Ctrl-C: serve run shuts down Serve and the Ray it started. Whether it ended within 120 s
    (else its process group, which only this module started, is killed)."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Every YAML this run tests, started at once: name -> Started. A test stops its own; what a
    failed test left running is stopped here."""
    chosen = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}  # fmt: skip
    runs = {name: _start(name, tmp_path_factory.mktemp(name.removesuffix(".yaml"))) for name in CPU_YAMLS
            if name in chosen}  # fmt: skip
    try:
        yield runs
    finally:
        for run in runs.values():
            _stop(run.proc)


@pytest.mark.parametrize("name", CPU_YAMLS)
def test_cpu_yaml_starts_answers_and_stops_on_two_cpus(name, started):
    run = started[name]
    proc, path, port, guarded = run.proc, run.path, run.port, run.guarded
    assert f'eval "$(vae-service guard-env deploy/{name})"' in (DEPLOY / name).read_text()
    try:
        url = f"http://127.0.0.1:{port}"
        models = _models(_wait_healthy(url, proc))
        assert models
        grpc_port = yaml.safe_load(path.read_text())["grpc_options"]["port"]
        assert _shares_a_port(port, grpc_port) is not guarded
        with VaeClient(url, timeout=300) as client:
            for model, info in models.items():
                shape = (1, info["latent_channels"]) + ((1,) if info["family"] == "video" else ()) + (4, 6)
                z = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
                resp = client.decode(z, model=model)
                expected = (1, 1, 32, 48, 3) if info["family"] == "video" else (1, 32, 48, 3)
                assert (resp.model, resp.output.shape, resp.output.dtype) == (model, expected, np.uint8)
    finally:
        stopped_on_ctrl_c = _stop(proc)
    assert stopped_on_ctrl_c, "serve run was still running 120 s after Ctrl-C"
    warned = "no proxy guard (token, body limits, own ports) in Serve's proxy" in run.log.read_text()
    assert warned is not guarded
    deadline = time.monotonic() + 30  # and the HTTP proxy goes with it
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            break
        assert time.monotonic() < deadline, f"{url} still answers after serve run stopped"
        time.sleep(0.1)
