"""A newcomer's first hour, run as one would: the README's commands as written, in a shell whose
PATH does not hold the service's venv, against one `make serve` started once (the venv CI already
built is reused: a fresh one is test_client_only's point, not this file's).

What a new user met before (issue #31): a second service sharing the first one's port, a mistyped
model taking 40 s and 223 log lines to fail, a float64 .npy crashing the CLI, tracebacks and
messages naming the wrong field, an alarming start-up. Each test here says what it guards.
Waits are on the processes' own output, never on a clock."""

import dataclasses
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.doc_examples import SERVICES, all_examples
from tests.integration.conftest import TEST_DEPLOYMENT
from tests.ports import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # the venv `make` built (CI's): its bin is not on a new shell's PATH
MAX_LINE = 200  # Ray prefixes each line it relays with the process and Serve's own fields (~110 chars)


def new_shell_env(**extra) -> dict:
    """A new terminal's environment: no venv on PATH, no Ray of this test session to join."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != VENV_BIN)
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "VIRTUAL_ENV", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH",
            "VAE_SERVICE_ADMISSION")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PATH": path, **extra}


class Output:
    """A process's merged stdout and stderr, line by line as it prints them."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def until(self, predicate, timeout_s: float) -> str:
        """The first line for which `predicate` holds; fails when the process ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such line within {timeout_s} s:\n" + "\n".join(self.lines[-40:])) from None
            if line is None:
                raise AssertionError(f"exited with {self.proc.wait()}:\n" + "\n".join(self.lines[-40:]))
            self.lines.append(line)
            if predicate(line):
                return line


def make(*args: str, stdout=subprocess.PIPE, **env) -> subprocess.Popen:
    """`make ARGS` in the checkout (VENV= only where the tests run in a venv other than its .venv);
    its output to `stdout` (a pipe, or a file)."""
    venv = [] if VENV_BIN.parent == REPO / ".venv" else [f"VENV={VENV_BIN.parent}"]
    return subprocess.Popen(
        ["make", *args, *venv],
        cwd=REPO,
        env=new_shell_env(**env),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finished(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    """Its exit status, output and run time; a process still running after `timeout_s` (a second
    service that started after all) is stopped, with the process group this file started for it."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"still running after {timeout_s} s: {proc.args}") from None
    return proc.returncode, out, time.monotonic() - start


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C for the process group `make` started (start_new_session), then a kill if it lingers."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


MISFIT = "test_a_model_that_fails_in_its_replica_is_one_line_and_one_traceback_per_attempt"


@pytest.fixture(scope="module")
def misfit(tmp_path_factory, kl_dir):
    """`make serve` of a folder that passes every check before Ray (a served class, weights present)
    whose weights do not fit its config (MISFIT's case): (the folder, the process, its output file).
    Started with the module (`_start_early`), its own Ray and its replica's attempts run beside
    `served`'s start-up instead of after it; MISFIT waits for it to end."""
    folder = tmp_path_factory.mktemp("misfit")
    config = json.loads((kl_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "latent_channels": 8}))
    (folder / "diffusion_pytorch_model.safetensors").symlink_to(kl_dir / "diffusion_pytorch_model.safetensors")
    log = tmp_path_factory.mktemp("misfit-output") / "make.log"
    with log.open("w") as out:  # the process writes through its own descriptor
        proc = make("serve", f"MODEL={folder}", f"PORT={free_port()}", stdout=out)
    yield folder, proc, log
    if proc.poll() is None:  # MISFIT did not run to its end
        stop(proc)


@pytest.fixture(scope="module", autouse=True)
def _start_early(request):
    """Starts `misfit` before the module's first test, where this run holds MISFIT."""
    if any(item.module is request.module and item.originalname == MISFIT for item in request.session.items):
        request.getfixturevalue("misfit")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`make serve` as the README says (its default model, the `sd` preset the documents' examples
    assume; ports as it documents them), stopped with Ctrl-C at the end."""
    port, grpc_port = free_port(), free_port()
    proc = make("serve", f"PORT={port}", f"GRPC_PORT={grpc_port}")
    output = Output(proc)
    try:
        output.until(lambda line: line.startswith("vae-service is serving"), timeout_s=600)
        command = output.until(lambda line: "decode --url" in line, timeout_s=60)
        yield {"port": port, "grpc_port": grpc_port, "output": output, "command": command}
    finally:
        stop(proc)


def test_start_up_is_a_short_true_banner_ending_with_the_command_to_try(served):
    lines = served["output"].lines
    start = next(i for i, line in enumerate(lines) if line.startswith("vae-service is serving"))
    banner = lines[start : lines.index(served["command"]) + 1]
    assert "SEEDED RANDOM WEIGHTS: it decodes noise" in banner[0] and "tiers lossless, high, preview" in banner[0]
    assert banner[1] == f"  HTTP  http://127.0.0.1:{served['port']}  POST /decode, POST /remote-decode, GET /health"
    assert f"gRPC  port {served['grpc_port']}" in banner[2] and "all interfaces" in banner[2]
    assert banner[-2].startswith("Ctrl-C stops it. Try it from another shell")
    assert len(banner) == 5  # nothing of Ray's between: the command is the banner's last line
    # before: a "!!!!" box about gRPC whose fix `make serve` could not pass; Ray's "New http_options
    # ... will not be applied" (they were); one INFO line of 3,495 characters before "Try it"
    assert not [line for line in lines if "!!!" in line or "will not be applied" in line]
    assert max(len(line) for line in lines) <= MAX_LINE, max(lines, key=len)


def test_the_printed_command_runs_as_printed_in_a_new_shell(served, tmp_path):
    run = subprocess.run(
        shlex.split(served["command"]), cwd=tmp_path, env=new_shell_env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert Image.open(tmp_path / "out" / "random.png").size == (128, 128)


@pytest.fixture(scope="module")
def tiny_wan_url(ray_cluster):
    """What `make serve MODEL=tiny-wan` serves (the preset, as the CLI deploys it: torch on every
    core, cpu_threads unset), in this session's cluster: a second `make serve` would start a second Ray."""
    from ray import serve

    from vae_service.serving.app import decoder_app

    serve.run(decoder_app({"model": "tiny-wan"}, **TEST_DEPLOYMENT), name="tiny-wan", route_prefix="/tiny-wan")
    yield f"{ray_cluster}/tiny-wan"
    serve.delete("tiny-wan")


RUNNABLE = [e for e in all_examples() if e.kind in (*SERVICES, "standalone")]
WRITES = re.compile(r"\b[\w/-]+\.(?:png|mp4|webm|webp|avif)\b")  # the files an example says (code or comment) it writes


@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: e.id)
def test_every_documented_example_runs_as_written(example, request, tmp_path):
    """Each example of README.md and docs/ against the service its tag names (tests/doc_examples.py),
    in a new shell with the venv's bin on PATH (as the README says), in a folder holding the latent
    files the examples name; only the service's address differs from the text."""
    env = new_shell_env(PATH=f"{VENV_BIN}{os.pathsep}{new_shell_env()['PATH']}")
    code = example.code
    if example.kind == "make serve":
        url, grpc = f"http://127.0.0.1:{request.getfixturevalue('served')['port']}", request.getfixturevalue("served")
        code = code.replace("127.0.0.1:9000", f"127.0.0.1:{grpc['grpc_port']}")
    elif example.kind == "make serve MODEL=tiny-wan":
        url = request.getfixturevalue("tiny_wan_url")
    else:
        url = None
    if "vae-service batch-decode" in example.code:
        # `batch-decode` joins RAY_ADDRESS's Ray when set (its --help says so): this session's
        # (tests/integration/conftest.py), rather than a local Ray of its own started beside it for
        # one latent (what the CLI does to start one is `make serve`'s, run by the fixture above)
        import ray

        request.getfixturevalue("ray_cluster")
        env.update(RAY_ADDRESS=ray.get_runtime_context().gcs_address, RAY_AUTH_MODE="disabled")
    if url:
        code, env["VAE_SERVICE_URL"] = code.replace("http://127.0.0.1:8000", url), url
    latents = np.random.default_rng(0).standard_normal((1, 4, 16, 16)).astype(np.float32)
    np.save(tmp_path / "latents.npy", latents)
    (tmp_path / "latents").mkdir()
    np.save(tmp_path / "latents" / "a.npy", latents)
    as_written = dataclasses.replace(example, code=code)  # the address changed, nothing else
    runs = [[str(VENV_BIN / "python"), "-c", code]] if example.language == "python" else as_written.commands()
    for run in runs:
        done = subprocess.run(run, shell=isinstance(run, str), cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"{run}\n{done.stdout}\n{done.stderr}"
    for name in WRITES.findall(example.code):
        assert (tmp_path / name).stat().st_size > 0, name
        if name.endswith(".png"):
            Image.open(tmp_path / name).verify()
    if example.document == "README.md" and "out.png" in WRITES.findall(example.code):  # the first decode's size
        assert Image.open(tmp_path / "out.png").size == (256, 256)


@pytest.mark.parametrize("which", ["HTTP", "gRPC"])
def test_a_second_service_on_a_port_in_use_is_refused_in_one_line_within_seconds(served, which):
    """Before: a second `make serve` on the same port started, printed "serving at ...", and the
    kernel split requests between the two models."""
    ports = (served["port"], free_port()) if which == "HTTP" else (free_port(), served["grpc_port"])
    taken = served["port"] if which == "HTTP" else served["grpc_port"]
    code, out, seconds = finished(make("serve", "MODEL=tiny-wan", f"PORT={ports[0]}", f"GRPC_PORT={ports[1]}"), 120)
    ours = [line for line in out.splitlines() if line.startswith("vae-service:")]
    assert code != 0 and len(ours) == 1 and f"port {taken} ({which})" in ours[0], out
    assert "Traceback" not in out and "starting Ray" not in out and seconds < 60


def test_the_services_ports_are_its_own(served):
    """Serve binds with SO_REUSEPORT by default: another process doing the same would share them."""
    for family, host, port in (
        (socket.AF_INET, "127.0.0.1", served["port"]),
        (socket.AF_INET6, "::", served["grpc_port"]),
    ):
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError, match="Address already in use"):
                sock.bind((host, port))


def test_a_mistyped_model_is_one_line_with_close_matches_in_seconds():
    """Before: 40 s and 223 log lines (Ray started, three replicas failed, each with a second
    unrelated traceback: tests/unit/test_replica_lifecycle.py), the useful line being line 62."""
    code, out, seconds = finished(make("serve", "MODEL=tiny-k1", f"PORT={free_port()}"), 120)
    ours = [line for line in out.splitlines() if line.startswith("vae-service:")]
    text = "model: 'tiny-k1' is neither a preset, a local folder nor a hub id (org/name); did you mean 'tiny-kl'"
    assert code != 0 and len(ours) == 1 and text in ours[0], out
    assert "Traceback" not in out and "starting Ray" not in out and seconds < 60


def test_a_model_that_fails_in_its_replica_is_one_line_and_one_traceback_per_attempt(misfit):
    """A folder that passes every check before Ray (a served class, weights present) whose weights
    do not fit its config (`misfit`, started with the module): the replica's constructor raises,
    and Serve's destructor call after it adds nothing (before: `'VaeDecoderHttp' object has no
    attribute 'service'` each time)."""
    folder, proc, log = misfit
    code, _, _ = finished(proc, 600)
    out = log.read_text()
    ours = [line for line in out.splitlines() if line.startswith("vae-service:") and "starting Ray" not in line]
    assert code != 0 and len(ours) == 1 and f"model: weights in '{folder}' do not match its config" in ours[0], out
    assert "has no attribute 'service'" not in out


def test_decode_casts_a_float64_npy_and_the_servers_refusal_is_one_line(served, tmp_path):
    """Before: a float64 .npy (NumPy's default dtype) crashed `vae-service decode` with a traceback.
    (What the client refuses before sending, and unreadable files: tests/unit/test_cli.py.)"""
    url = f"http://127.0.0.1:{served['port']}"
    rng = np.random.default_rng(0)
    np.save(tmp_path / "f64.npy", rng.standard_normal((1, 4, 8, 8)))
    np.save(tmp_path / "one.npy", rng.standard_normal((4, 8, 8)).astype(np.float32))  # no batch dimension
    cli = [str(VENV_BIN / "vae-service"), "decode", "--url", url, "--out", str(tmp_path / "out")]

    def run(name):
        done = subprocess.run([*cli, str(tmp_path / name)], env=new_shell_env(), capture_output=True, text=True)
        assert "Traceback" not in done.stderr, done.stderr
        return done.returncode, [line for line in done.stderr.splitlines() if line.startswith("vae-service:")]

    code, said = run("f64.npy")
    assert code == 0 and said == ["vae-service: f64.npy holds float64 latents: sending them as float32"]
    assert Image.open(tmp_path / "out" / "f64.png").size == (64, 64)  # named after its input
    code, said = run("one.npy")  # the server's 400, naming the missing batch dimension
    assert code == 1 and said == [
        "vae-service: HTTP 400 invalid_request: latents: shape [4, 8, 8] has no batch dimension: send [1, 4, 8, 8] "
        "(or, for packed latents [B, L, 16], give height and width)"
    ]


def test_errors_name_the_right_field_over_http_and_grpc(served):
    from vae_service_client import InvalidRequest, VaeClient, VaeGrpcClient

    z = np.zeros((1, 4, 8, 8), np.float32)
    with VaeClient(f"http://127.0.0.1:{served['port']}") as client:
        with pytest.raises(InvalidRequest) as err:
            client.decode(z, height=64, width=64)  # before: silently ignored
        assert err.value.field == "height" and "only for packed latents" in err.value.message
        with pytest.raises(InvalidRequest, match="qualty: unknown argument; did you mean 'quality'"):
            client.decode(z, qualty="high")  # before: a TypeError about an internal function
        url, msgpack = f"http://127.0.0.1:{served['port']}/decode", {"content-type": "application/msgpack"}
        garbage = httpx.post(url, content=b"\xc1 garbage", headers=msgpack)
        assert garbage.status_code == 400
        message = garbage.json()["error"]["message"]
        assert message == "body: is not a msgpack /decode map: not msgpack (an invalid first byte or type)"
    grpc = VaeGrpcClient(f"127.0.0.1:{served['grpc_port']}", application="vae")
    with grpc, pytest.raises(InvalidRequest) as err:
        grpc.decode(z[:, :3])
    assert str(err.value).startswith("gRPC INVALID_ARGUMENT invalid_request: latents: model 'sd' takes [B, 4")


def test_the_streaming_cli_shows_each_chunk_as_it_arrives(wan_url, tmp_path):
    """Before: nothing between the first and the last chunk (85 s of silence on a Wan clip)."""
    cli = [str(VENV_BIN / "vae-service"), "decode", "--url", wan_url, "--random-latents", "1x4x3x4x4", "--stream"]
    done = subprocess.run([*cli, "--out", str(tmp_path)], env=new_shell_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("first frames after ")
    chunks = [line.split(" after ")[0] for line in done.stdout.splitlines() if line.startswith("item ")]
    assert chunks == ["item 0: frames 0-0", "item 0: frames 1-4", "item 0: frames 5-8"]  # Wan: 1, then 4 per latent
    assert len(list(tmp_path.glob("random-frame*.png"))) == 9


def test_api_docs_need_the_token_when_one_is_configured(app, tmp_path):
    token = tmp_path / "token"
    token.write_text("newcomer-token")
    url = app("docs-locked", auth_token_file=str(token))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"authorization": "Bearer newcomer-token"}).status_code == 200
    schema = httpx.get(f"{url}/openapi.json", headers={"authorization": "Bearer newcomer-token"}).json()
    assert "/decode" in schema["paths"] and "/docs" not in schema["paths"]
    page = httpx.get(f"{url}/docs", headers={"authorization": "Bearer newcomer-token"}).text
    assert "/docs-locked/openapi.json" in page  # the schema under the app's route prefix
