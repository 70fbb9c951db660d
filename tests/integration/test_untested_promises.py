"""README promises that had no test of their own (issue #18), on the real local Serve with real
clients: `lossless` over max_decode_bytes is a 413 that points at `high`; the bearer token guards
the streamed paths (HTTP `stream: true`, gRPC DecodeFrames and DecodeStream) before any frame; the
router takes its token from VAE_SERVICE_AUTH_TOKEN; a gRPC client cancelling DecodeFrames stops the decode; the
proxy guard refuses a declared Content-Length over its budget before any body byte arrives."""

import json
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import numpy as np
import pytest
import torch
from ray import serve

from tests.integration.conftest import TEST_DEPLOYMENT
from vae_service.serving.app import decoder_app
from vae_service.serving.scheduling.admission import TOKEN_ENV
from vae_service_client import PayloadTooLarge, Unauthenticated, VaeClient, VaeGrpcClient
from vae_service_client.frames import assemble
from vae_service_client.grpc_client import carries_something
from vae_service_client.grpc_gen import decode_pb2_grpc
from vae_service_client.messages import MSGPACK, pack, request_map, request_proto

pytestmark = pytest.mark.integration
TOKEN = "issue-18-token"
# tiny-kl at 32x32 latents needs ~26 MiB whole (six times this); `high` tiles fit in it
MAX_DECODE_BYTES = 4 * 2**20
# far over the proxy guard's budget (64 MiB in these tests), far under the replica's own (below)
DECLARED_BYTES = 2**40


def video(frames=2, h=4, w=4, seed=0):
    return torch.randn(1, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def bounded_url(ray_cluster, kl_dir):
    """tiny-kl with a small decode memory bound, and a body limit of its own far above the proxy
    guard's, so a declared size between the two can only be refused by the guard (one deployment
    serves both promises: deployments are the slow part of this module)."""
    config = {
        "model": str(kl_dir),
        "model_name": "bounded",
        "cpu_threads": 1,
        "limits": {"max_decode_bytes": MAX_DECODE_BYTES, "max_request_bytes": 2 * DECLARED_BYTES},
    }
    serve.run(decoder_app(config, **TEST_DEPLOYMENT), name="bounded", route_prefix="/bounded")
    yield f"{ray_cluster}/bounded"
    serve.delete("bounded")


@pytest.fixture(scope="module")
def locked_wan(ray_cluster, wan_dir):
    """A video model as its own HTTP ingress, behind TOKEN (from the replica's environment)."""
    options = dict(TEST_DEPLOYMENT, ray_actor_options={"runtime_env": {"env_vars": {TOKEN_ENV: TOKEN}}})
    config = {"model": str(wan_dir), "model_name": "wan", "cpu_threads": 1}
    serve.run(decoder_app(config, **options), name="wanlocked", route_prefix="/wanlocked")
    yield f"{ray_cluster}/wanlocked"
    serve.delete("wanlocked")


@pytest.fixture(scope="module")
def env_router(ray_cluster, kl_dir):
    """The multi-model app with VAE_SERVICE_AUTH_TOKEN in its environment and no token file.
    multi_model_app passes deployment options to the decoders only, so the router's environment is
    set the way `serve deploy` sets an application's (its runtime_env), which reaches every actor
    of the application, the router included."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    fast_shutdown = [{"name": name, **TEST_DEPLOYMENT} for name in ("VaeRouter", "VaeDecoder-kl")]
    app = {
        "name": "envrouter",
        "route_prefix": "/envrouter",
        "import_path": "vae_service.serving.app:build_multi_app",
        "args": {"models": [{"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1}]},
        "runtime_env": {"env_vars": {TOKEN_ENV: TOKEN}},
        "deployments": fast_shutdown,
    }
    _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))
    deadline = time.monotonic() + 300
    while (state := serve.status().applications.get("envrouter")) is None or state.status != "RUNNING":
        assert state is None or state.status not in ("DEPLOY_FAILED", "UNHEALTHY"), state.message
        assert time.monotonic() < deadline, f"envrouter is not running: {state}"
        time.sleep(0.2)
    while "/envrouter" not in httpx.get(f"{ray_cluster}/-/routes").json():  # the proxy learns routes later
        assert time.monotonic() < deadline, "the proxy never routed /envrouter"
        time.sleep(0.2)
    yield f"{ray_cluster}/envrouter"
    serve.delete("envrouter")


# ---- 1. lossless over limits.max_decode_bytes ------------------------------------------------


def test_lossless_over_max_decode_bytes_is_tiled_else_413_naming_latents_and_suggesting_high(bounded_url):
    small = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    with VaeClient(bounded_url, retries=0) as client:  # over the bound, within it by the model's own tiles
        tiled = client.decode(small, "lossless")
    assert tiled.tiled and tiled.quality == "lossless" and tiled.output.shape == (1, 256, 256, 3)
    z = torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(1))  # even its own tiles do not fit
    body = pack(request_map(z, "lossless"))  # priced on the meta twin, tile by tile: seconds
    r = httpx.post(f"{bounded_url}/decode", content=body, headers={"content-type": MSGPACK}, timeout=60)
    assert r.status_code == 413, (r.status_code, r.content[:300])
    err = r.json()["error"]
    assert (err["type"], err["field"]) == ("payload_too_large", "latents")
    assert err["message"].startswith("latents") and "max_decode_bytes" in err["message"]
    assert "'high'" in err["message"] and "even diffusers' tiled decode" in err["message"]
    with VaeClient(bounded_url, retries=0) as client:
        with pytest.raises(PayloadTooLarge) as raised:
            client.decode(z, "lossless")
        assert (raised.value.status, raised.value.field) == (413, "latents")
        # `high` decodes in tiles within the bound, as the message suggests
        high = client.decode(small, "high")
    assert high.tiled and high.output.shape == (1, 256, 256, 3)


# ---- 2. the token on the streamed paths ------------------------------------------------------


def test_streamed_http_decode_needs_the_token_before_any_frame(locked_wan):
    body = pack(request_map(video(), stream=True))
    with httpx.Client(timeout=60) as http:
        for auth in ({}, {"authorization": "Bearer wrong"}):
            headers = {"content-type": MSGPACK, **auth}
            with http.stream("POST", f"{locked_wan}/decode", content=body, headers=headers) as r:
                r.read()
            # an ordinary JSON error, not a frame stream that fails later
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.headers["content-type"] == "application/json"
            assert r.json()["error"]["type"] == "unauthenticated"
    with VaeClient(locked_wan, retries=0) as client, pytest.raises(Unauthenticated):
        next(iter(client.decode_frames(video())))
    with VaeClient(locked_wan, token=TOKEN) as client:
        stream = client.decode_frames(video())
        chunks = list(stream)
        whole = client.decode(video()).output
    assert [c.frame for c in chunks] == [0, 1]  # one chunk per latent frame: streamed, not whole
    assert stream.summary.model == "wan"
    np.testing.assert_array_equal(assemble(chunks), whole)


def test_grpc_streams_need_the_token_before_any_frame(locked_wan, grpc_target):
    request = request_proto(video())
    with grpc.insecure_channel(grpc_target) as channel:
        stub = decode_pb2_grpc.VaeDecoderStub(channel)
        for auth in ((), (("authorization", "Bearer wrong"),)):
            received = []
            with pytest.raises(grpc.RpcError) as err:
                for message in stub.DecodeFrames(request, metadata=(("application", "wanlocked"), *auth), timeout=60):
                    received.append(message)
            # at most the empty message that carries the status through Serve's proxy: no frame
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not any(carries_something(m) for m in received) and len(received) <= 1
            assert dict(err.value.trailing_metadata())["error-field"] == "Authorization"
    for token in (None, "wrong"):
        with VaeGrpcClient(grpc_target, application="wanlocked", token=token, retries=0) as client:
            with pytest.raises(Unauthenticated):
                list(client.decode_frames(video()))
            with pytest.raises(Unauthenticated):
                list(client.decode_stream(video()))
    with VaeGrpcClient(grpc_target, application="wanlocked", token=TOKEN) as client:
        stream = client.decode_frames(video())
        chunks = list(stream)
    assert [c.frame for c in chunks] == [0, 1] and stream.summary.model == "wan"
    with VaeClient(locked_wan, token=TOKEN) as http:
        np.testing.assert_array_equal(assemble(chunks), http.decode(video()).output)


# ---- 3. the router's token from the environment ----------------------------------------------


def test_router_takes_its_token_from_the_environment(env_router, grpc_target):
    body = pack(request_map(torch.zeros(1, 4, 2, 2)))
    for auth in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.post(f"{env_router}/decode", content=body, headers={"content-type": MSGPACK, **auth})
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthenticated"
        assert httpx.get(f"{env_router}/health", headers=auth).status_code == 401
    with VaeClient(env_router, token=TOKEN) as client:
        assert client.health()["auth"] == "bearer"
        assert client.decode(torch.zeros(1, 4, 2, 2)).output.shape == (1, 16, 16, 3)
    with VaeGrpcClient(grpc_target, application="envrouter", retries=0) as client, pytest.raises(Unauthenticated):
        client.decode(torch.zeros(1, 4, 2, 2))
    with VaeGrpcClient(grpc_target, application="envrouter", token=TOKEN) as client:
        assert client.decode(torch.zeros(1, 4, 2, 2)).output.shape == (1, 16, 16, 3)


# ---- 4. a gRPC client cancelling DecodeFrames ------------------------------------------------


def test_cancelling_grpc_decode_frames_stops_the_decode(locked_wan, grpc_target):
    # 65 latent frames at 32x32: about two minutes whole on one CPU thread, a second or two each,
    # so the replica goes idle within the wait below only if the decode stops when cancelled
    clip = video(frames=65, h=32, w=32, seed=2)
    metadata = (("application", "wanlocked"), ("authorization", f"Bearer {TOKEN}"))
    with VaeClient(locked_wan, token=TOKEN) as http:
        with grpc.insecure_channel(grpc_target) as channel:
            call = decode_pb2_grpc.VaeDecoderStub(channel).DecodeFrames(request_proto(clip), metadata=metadata)
            first = next(call)
            assert (first.WhichOneof("kind"), first.chunk.item_index, first.chunk.frame_start) == ("chunk", 0, 0)
            assert http.health()["running_batches"] == 1  # the rest of the clip is being decoded
            call.cancel()
        deadline = time.monotonic() + 30
        while (health := http.health())["running_batches"] or health["queued_items"]:
            assert time.monotonic() < deadline, f"the cancelled decode is still running: {health}"
            time.sleep(0.1)
    with VaeGrpcClient(grpc_target, application="wanlocked", token=TOKEN, retries=0) as client:
        assert client.decode(video(seed=3)).output.shape == (1, 5, 32, 32, 3)


# ---- 5. a declared Content-Length over the proxy guard's budget ------------------------------


def _headers_only_post(url: str, declared: int, read_timeout_s: float) -> tuple[int, dict, bytes]:
    """POST the headers with `declared` as Content-Length and never a body byte; read the answer
    (bounded: a server waiting for the body times the read out instead of hanging the test)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=read_timeout_s) as sock:
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: {MSGPACK}\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode())
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed without an answer: {received!r}"
            received += chunk
        head, body = received.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-answer"
            body += chunk
    return int(lines[0].split()[1]), headers, body


def test_a_declared_oversized_body_is_refused_by_the_proxy_before_any_body_byte(bounded_url):
    """Nothing is ever sent after the headers: a 413 here was decided from the declared size
    alone. The replica behind accepts this size (its own limit is higher), and a guard that waited
    for the body would answer 408 at its body deadline, so only the guard's declared-size check
    answers 413."""
    status, headers, body = _headers_only_post(f"{bounded_url}/decode", DECLARED_BYTES, read_timeout_s=60)
    assert status == 413, body
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert (err["type"], err["field"]) == ("payload_too_large", "body")
    assert str(DECLARED_BYTES) in err["message"]


# ---- 6. the example call `make serve` prints runs from a new shell ---------------------------


def test_the_printed_example_runs_from_a_new_shell(kl_url, tmp_path):
    """As a newcomer pastes it into another terminal: no virtual environment on the PATH, another
    working directory."""
    from vae_service.cli import example_command

    command = example_command(kl_url, "1x4x8x8")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["random.png"]


def test_the_readmes_first_decode_runs_as_written(kl_url, tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = readme.split("## A first decode", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8000" in snippet
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet.replace("http://127.0.0.1:8000", kl_url), "README.md", "exec"), {})
    from PIL import Image

    assert Image.open(tmp_path / "out.png").size == (256, 256)  # 32 latent px x the tiny KL's 8
