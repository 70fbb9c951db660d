"""`priority` (the scheduler's class) on every surface: each server-side parser (a msgpack /decode
body, /remote-decode's query, a gRPC DecodeRequest, a handle call, a session's `open` over the
WebSocket and over gRPC) hands it to DecodeRequest/SessionOpen unchanged, None where absent, and
refuses an unknown name or a wrong type naming `priority`. Every client (HTTP sync and async,
decode and streams; gRPC; both session clients; RemoteVae; the CLI) puts it on the wire when given
and leaves it off otherwise, checked on what real local servers received. batch-decode's items
are `bulk` unless the job names another class. Which classes a deployment lets callers claim is
the service's check (tests/integration/test_priority_claims.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import grpc
import msgpack
import numpy as np
import pytest
import torch
from websockets.sync.server import serve as ws_serve

from tests.models import torch_threads
from vae_service.batch.job import decode_dataset
from vae_service.batch.stage import DecodeStage
from vae_service.cli import main
from vae_service.config import Limits
from vae_service.engine.request.errors import InvalidInput
from vae_service.names import PRIORITIES
from vae_service.protocol.hf_remote import parse_remote_decode
from vae_service.protocol.requests import parse_decode_body, request_from_call, request_from_proto
from vae_service.protocol.sessions import parse_message, session_open
from vae_service_client import AsyncVaeClient, VaeClient, VaeGrpcClient, VaeServiceError
from vae_service_client import messages as client_messages
from vae_service_client.errors import error_json
from vae_service_client.grpc_gen import decode_pb2, decode_pb2_grpc
from vae_service_client.messages import MSGPACK, pack, request_map, request_proto
from vae_service_client.session_proto import request_map as session_request_map
from vae_service_client.session_proto import request_proto as session_request_proto
from vae_service_client.sessions import open_fields

Z = np.random.default_rng(0).standard_normal((1, 4, 2, 2), dtype=np.float32)
MAX_BYTES = Limits().max_request_bytes
OPEN = {"height": 4, "width": 4}


def test_the_clients_copy_of_the_class_names_is_the_services():
    assert client_messages.PRIORITIES == PRIORITIES == ("realtime", "interactive", "bulk")


# ---- server side: every parser -------------------------------------------------------------------
def over_msgpack(body: dict):
    return parse_decode_body(pack(body), MSGPACK, MAX_BYTES)


def over_remote_decode(query: dict):
    shape = [str(d) for d in Z.shape]
    return parse_remote_decode(
        Z.tobytes(), "tensor/binary", None, {"shape": shape, "output_type": ["pt"], **query}
    ).request


def over_grpc(msg) -> object:
    return request_from_proto(decode_pb2.DecodeRequest.FromString(msg.SerializeToString()))


def over_websocket_open(fields: dict):
    kind, opened = parse_message(pack({"open": fields}), MAX_BYTES)
    assert kind == "open"
    return session_open(opened)


def over_grpc_open(proto) -> object:
    wire = decode_pb2.SessionRequest(open=proto).SerializeToString()
    kind, fields = session_request_map(decode_pb2.SessionRequest.FromString(wire))
    assert kind == "open"
    return session_open(fields)


@pytest.mark.parametrize("priority", PRIORITIES)
def test_every_way_in_hands_the_class_over_unchanged(priority):
    body = request_map(Z, priority=priority)
    assert body["priority"] == priority
    assert over_msgpack(body).priority == priority
    assert over_remote_decode({"priority": [priority]}).priority == priority
    assert over_grpc(request_proto(Z, priority=priority)).priority == priority
    assert request_from_call(torch.from_numpy(Z), priority=priority).priority == priority
    assert request_from_call(Z, quality="high", priority=priority).priority == priority  # numpy, another option
    assert over_websocket_open({**OPEN, "priority": priority}).priority == priority
    assert over_grpc_open(decode_pb2.SessionOpen(**OPEN, priority=priority)).priority == priority
    # the client's own gRPC open message, as DecodeSession's servicer reads it
    _, fields = session_request_map(session_request_proto({"open": open_fields(4, 4, priority=priority)}))
    assert session_open(fields).priority == priority


def test_every_way_in_without_a_class_leaves_it_to_the_service():
    assert "priority" not in request_map(Z)
    assert over_msgpack(request_map(Z)).priority is None
    assert over_remote_decode({}).priority is None
    assert over_grpc(request_proto(Z)).priority is None
    assert over_grpc(decode_pb2.DecodeRequest(latents=request_proto(Z).latents, priority="")).priority is None
    assert request_from_call(Z).priority is None
    assert over_websocket_open(OPEN).priority is None
    assert over_grpc_open(decode_pb2.SessionOpen(**OPEN)).priority is None
    assert over_grpc_open(decode_pb2.SessionOpen(**OPEN, priority="")).priority is None  # proto3: "" is absent


@pytest.mark.parametrize("bad", ["urgent", "Bulk", "", 3, True, ["bulk"], {"bulk": 1}, 0.5])
def test_an_unknown_class_or_a_wrong_type_is_refused_naming_priority(bad):
    refusals = [
        lambda: over_msgpack({**request_map(Z), "priority": bad}),
        lambda: request_from_call(Z, priority=bad),
        lambda: over_websocket_open({**OPEN, "priority": bad}),
    ]
    if isinstance(bad, str) and bad:  # a query string and a proto3 string field only carry strings ("": absent)
        refusals += [
            lambda: over_remote_decode({"priority": [bad]}),
            lambda: over_grpc(decode_pb2.DecodeRequest(latents=request_proto(Z).latents, priority=bad)),
            lambda: over_grpc_open(decode_pb2.SessionOpen(**OPEN, priority=bad)),
        ]
    for refuse in refusals:
        with pytest.raises(InvalidInput) as err:
            refuse()
        assert err.value.field == "priority", str(err.value)
        assert "bulk" in str(err.value)  # the message lists the classes


def test_a_misspelled_class_gets_a_close_match():
    with pytest.raises(InvalidInput, match="did you mean 'interactive'"):
        over_msgpack({**request_map(Z), "priority": "interactve"})


# ---- clients: what goes on the wire ----------------------------------------------------------------
class Recorder(ThreadingHTTPServer):
    """A real HTTP server that keeps every request's (method, path, body) and refuses each decode
    with a 400 naming `priority` (so a client raises, and nothing is retried); /health answers what
    RemoteVae reads."""

    daemon_threads = True
    HEALTH: ClassVar[dict] = {
        "model": "kl",
        "config": {"latent_channels": 4, "scaling_factor": 0.18215},
        "precision": "fp32",
    }

    def __init__(self):
        self.received: list[tuple[str, str, bytes]] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.server.received.append(("GET", self.path, b""))
                self._answer(200, json.dumps(Recorder.HEALTH).encode())

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                self.server.received.append(("POST", self.path, body))
                self._answer(400, error_json("invalid_request", "priority", "recorded"))

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def bodies(self) -> list[dict]:
        """The msgpack bodies POSTed to /decode, in order, without their latents."""
        out = []
        for method, path, body in self.received:
            if method == "POST":
                assert path == "/decode", path
                out.append({k: v for k, v in msgpack.unpackb(body, raw=False).items() if k != "latents"})
        return out


@pytest.fixture
def recorder():
    server = Recorder()
    yield server
    server.shutdown()
    server.server_close()


def sync_calls(client: VaeClient, tmp_path, **options) -> None:
    """Every decode and stream call of the sync HTTP client, each refused by the recorder."""
    video = np.zeros((1, 4, 2, 2, 2), np.float32)
    for call in (
        lambda: client.decode(Z, **options),
        lambda: list(client.decode_frames(video, **options)),
        lambda: client.decode_video(video, tmp_path / "v.mp4", **options),
        lambda: client.decode_mp4(video, tmp_path / "v.mp4", **options),
    ):
        with pytest.raises(VaeServiceError) as err:
            call()
        assert err.value.status == 400


async def async_calls(client: AsyncVaeClient, tmp_path, **options) -> None:
    video = np.zeros((1, 4, 2, 2, 2), np.float32)

    async def frames():
        return [chunk async for chunk in client.decode_frames(video, **options)]

    for call in (
        lambda: client.decode(Z, **options),
        frames,
        lambda: client.decode_video(video, tmp_path / "v.webm", output="webm", **options),
    ):
        with pytest.raises(VaeServiceError) as err:
            await call()
        assert err.value.status == 400


def test_the_http_clients_send_the_class_only_when_given(recorder, tmp_path):
    with VaeClient(recorder.url, retries=0, timeout=10) as client:
        sync_calls(client, tmp_path, priority="bulk")
        sync_calls(client, tmp_path)

    async def run() -> None:
        async with AsyncVaeClient(recorder.url, retries=0, timeout=10) as client:
            await async_calls(client, tmp_path, priority="realtime")
            await async_calls(client, tmp_path)

    asyncio.run(run())
    bodies = recorder.bodies()
    assert len(bodies) == 4 + 4 + 3 + 3
    assert [b.get("priority") for b in bodies] == ["bulk"] * 4 + [None] * 4 + ["realtime"] * 3 + [None] * 3
    assert all("priority" not in b for b in bodies[4:8] + bodies[11:])  # absent, not nil
    assert [b.get("stream", False) for b in bodies[:4]] == [False, True, True, True]


def test_remote_vae_sends_its_class_with_every_decode(recorder):
    from vae_service_client.diffusers import RemoteVae

    z = torch.from_numpy(Z)
    for priority in ("bulk", None):
        vae = RemoteVae(recorder.url, priority=priority, retries=0, timeout=10)
        with pytest.raises(VaeServiceError):
            vae.decode(z)
        vae.close()
    first, second = recorder.bodies()
    assert first["priority"] == "bulk" and "priority" not in second
    assert first["tiling"] == second["tiling"] == "none"  # the rest of RemoteVae's request as before


class RecordingServicer(decode_pb2_grpc.VaeDecoderServicer):
    """A real gRPC server's servicer: keeps each request (a session's first message) and refuses it."""

    def __init__(self):
        self.received: list = []

    def _refuse(self, request, context):
        self.received.append(request)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "recorded")

    def Decode(self, request, context):  # noqa: N802 (the RPC's name)
        self._refuse(request, context)

    def DecodeStream(self, request, context):  # noqa: N802
        self._refuse(request, context)

    def DecodeFrames(self, request, context):  # noqa: N802
        self._refuse(request, context)

    def DecodeSession(self, requests, context):  # noqa: N802
        self._refuse(next(requests), context)


@pytest.fixture
def grpc_recorder():
    servicer = RecordingServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    decode_pb2_grpc.add_VaeDecoderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def grpc_calls(client: VaeGrpcClient, **options) -> None:
    """Decode, DecodeStream and DecodeFrames, each refused by the recorder."""
    video = np.zeros((1, 4, 2, 2, 2), np.float32)
    for call in (
        lambda: client.decode(Z, **options),
        lambda: list(client.decode_stream(Z, **options)),
        lambda: list(client.decode_frames(video, **options)),
    ):
        with pytest.raises(VaeServiceError):
            call()


def test_the_grpc_client_sends_the_class_only_when_given(grpc_recorder):
    servicer, target = grpc_recorder
    with VaeGrpcClient(target, retries=0, timeout=10) as client:
        grpc_calls(client, priority="interactive")
        grpc_calls(client)
    sent = [decode_pb2.DecodeRequest.FromString(m.SerializeToString()) for m in servicer.received]
    assert [m.priority for m in sent] == ["interactive"] * 3 + [""] * 3
    assert [request_from_proto(m).priority for m in sent] == ["interactive"] * 3 + [None] * 3


def test_the_grpc_session_client_opens_with_the_class_only_when_given(grpc_recorder):
    servicer, target = grpc_recorder
    with VaeGrpcClient(target, retries=0, timeout=10) as client:
        for options in ({"priority": "bulk"}, {}):
            with pytest.raises(VaeServiceError):
                client.session(4, 6, **options)
    opens = [request.open for request in servicer.received]
    assert [o.priority for o in opens] == ["bulk", ""]
    assert [(o.height, o.width) for o in opens] == [(4, 6), (4, 6)]


def test_the_websocket_session_client_opens_with_the_class_only_when_given():
    opens: list[dict] = []

    def handler(ws) -> None:
        opens.append(msgpack.unpackb(ws.recv(timeout=10), raw=False))
        ws.send(pack({"error": {"type": "invalid_request", "field": "priority", "message": "recorded"}}))

    with ws_serve(handler, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.socket.getsockname()[1]}"
        with VaeClient(url, retries=0, timeout=10) as client:
            for options in ({"priority": "realtime"}, {}):
                with pytest.raises(VaeServiceError) as err:
                    client.session(4, 6, **options)
                assert err.value.field == "priority"
    assert [list(o) for o in opens] == [["open"], ["open"]]
    assert opens[0]["open"]["priority"] == "realtime" and "priority" not in opens[1]["open"]
    assert session_open(opens[0]["open"]).priority == "realtime"


def test_a_client_refuses_nothing_it_need_not_know_the_service_names_the_class():
    """The class is the service's to check: a client sends what it is given (the service answers 400)."""
    assert request_map(Z, priority="urgent")["priority"] == "urgent"
    assert open_fields(4, 4, priority="urgent")["priority"] == "urgent"


# ---- the CLI -------------------------------------------------------------------------------------
def test_decode_sends_priority_only_when_given(recorder, tmp_path):
    for flags in (["--priority", "bulk"], []):
        with pytest.raises(SystemExit) as exit_:  # the recorder refuses the decode: one line, status 1
            main(["decode", "--random-latents", "1x4x2x2", "--url", recorder.url, "--out", str(tmp_path), *flags])
        assert exit_.value.code == 1
    first, second = recorder.bodies()
    assert first["priority"] == "bulk" and "priority" not in second


@pytest.mark.parametrize("command", ["decode", "batch-decode"])
def test_an_unknown_priority_flag_is_refused_before_anything_runs(command, tmp_path, capsys):
    argv = ["--random-latents", "1x4x2x2"] if command == "decode" else [str(tmp_path), str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main([command, *argv, "--priority", "urgent"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--priority" in err and "invalid choice: 'urgent'" in err
    assert not (tmp_path / "out").exists()


# ---- batch-decode --------------------------------------------------------------------------------
@pytest.fixture
def stage(kl_dir, tmp_path):
    def make(**kw) -> DecodeStage:
        return DecodeStage({"model": str(kl_dir), "cpu_threads": 1}, str(tmp_path / "out"), "npy", **kw)

    with torch_threads(torch.get_num_threads()):  # the stage binds its thread count; restore it after
        yield make


def test_batch_items_are_bulk_unless_the_job_names_another_class(stage, tmp_path):
    default, realtime = stage(), stage(priority="realtime", options={"request_id": "job"})
    assert default.request(Z).priority == "bulk"
    asked = realtime.request(Z)
    assert (asked.priority, asked.request_id, asked.output) == ("realtime", "job", "uint8")
    np.save(tmp_path / "z.npy", Z)
    out = default({"name": np.array(["z"]), "path": np.array([str(tmp_path / "z.npy")])})
    assert list(out["status"]) == ["decoded"], out["error"]  # a `bulk` item decodes as any other


def test_a_job_with_an_unknown_class_is_refused_before_any_engine_starts(tmp_path):
    with pytest.raises(ValueError, match="priority 'urgent'"):
        decode_dataset(None, {"model": "tiny-kl"}, str(tmp_path / "out"), priority="urgent")
