"""Hostile decode-session opens and chunks at the protocol and engine level (no Ray): every `open`
field is checked with bounds at open, before anything is priced or allocated, and a bad one is
answered as InvalidInput (400 invalid_request) or LimitExceeded (413 payload_too_large) naming the
field; nothing else raises. The conversation's own path: protocol.sessions.session_open, then
DecodeEngine.open_session (what SessionRegistry.open calls). Also: the empty chunk (client and
server name `latents`), a message over max_request_bytes (413 naming `latents`), the bearer
scheme in any case, and the proxy guard refusing a WebSocket handshake without the token before
the upgrade (a real uvicorn server and a real WebSocket client)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import numpy as np
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

from tests.fuzzing import session_opens
from tests.models import save_vae, torch_threads
from tests.ports import free_port
from tests.zoo import Case, build
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, InvalidInput, LimitExceeded
from vae_service.engine.request.session import (
    MAX_CLIP_LATENT_FRAMES,
    MAX_LATENT_SIDE,
    SESSION_DTYPES,
    SESSION_OUTPUTS,
    SessionOpen,
)
from vae_service.models.presets import PRESETS
from vae_service.names import PRIORITIES
from vae_service.protocol.errors import Unauthenticated, wire_error
from vae_service.protocol.sessions import chunk_of, chunk_request, parse_message, session_open
from vae_service.serving.scheduling.admission import Admission
from vae_service.serving.wire.proxy_guard import ProxyGuard, sized_uvicorn, websocket_message_limit
from vae_service_client import InvalidRequest
from vae_service_client.grpc_gen import decode_pb2
from vae_service_client.messages import pack
from vae_service_client.session_proto import request_map, request_proto
from vae_service_client.sessions import chunk_fields

TOKEN = "s3cret-token"
MAX_ID_CHARS = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> DecodeEngine:
    """tiny Wan (4 latent channels, spatial scale 8, 4 frames per latent frame after the first)."""
    folder = save_vae(
        build(Case("tiny-wan", "AutoencoderKLWan", PRESETS["tiny-wan"].config, ())), tmp_path_factory.mktemp("wan")
    )
    with torch_threads(1):
        yield DecodeEngine(ServiceConfig(model=str(folder), model_name="tiny-wan", device="cpu", cpu_threads=1))


def opening(engine: DecodeEngine, fields: dict):
    """What the conversation does with an `open` message's map."""
    return engine.open_session("session", session_open(fields))


def assert_within_bounds(engine: DecodeEngine, s: SessionOpen) -> None:
    """An open that was taken holds only settings inside the documented bounds."""
    for key in ("height", "width"):
        assert type(getattr(s, key)) is int and 1 <= getattr(s, key) <= MAX_LATENT_SIDE, (key, getattr(s, key))
    pixels = s.height * s.width * engine.spec.spatial_scale**2
    assert pixels <= engine.limits.max_output_pixels
    assert s.quality in ("lossless", "high") and s.output in SESSION_OUTPUTS and s.dtype in SESSION_DTYPES
    top = torch.finfo(SESSION_DTYPES[s.dtype]).max
    for key in ("scaling_factor", "shift_factor"):
        value = getattr(s, key)
        assert value is None or (type(value) is float and math.isfinite(value) and abs(value) <= top), (key, value)
    assert s.scaling_factor is None or 1 / abs(s.scaling_factor) <= top
    assert s.request_id is None or (type(s.request_id) is str and len(s.request_id) <= MAX_ID_CHARS)
    assert s.model in (None, engine.spec.name)
    assert s.clip_latent_frames is None or (
        type(s.clip_latent_frames) is int and 1 <= s.clip_latent_frames <= MAX_CLIP_LATENT_FRAMES
    )
    assert s.priority is None or s.priority in PRIORITIES


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=session_opens())
def test_every_hostile_open_is_refused_naming_its_field_or_opens_within_the_bounds(engine, case):
    fields, drawn = case
    try:
        session = opening(engine, fields)
    except InvalidInput as err:  # LimitExceeded is one
        # `latents`: a size at which one latent frame fits but a chunk of max_session_chunk_frames does not
        chunk_bound = isinstance(err, LimitExceeded) and err.field == "latents" and {"height", "width"} & drawn
        assert err.field in drawn or chunk_bound, (fields, err.field, str(err))
        assert wire_error(err).type == ("payload_too_large" if isinstance(err, LimitExceeded) else "invalid_request")
        return
    assert_within_bounds(engine, session.settings)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    height=st.integers(-(2**31), 2**31 - 1),
    width=st.sampled_from([5, -1, 2**31 - 1]),
    clip=st.integers(-(2**31), 2**31 - 1),
    scaling=st.one_of(st.none(), st.floats(allow_nan=True)),
    request_id=st.text(max_size=300),
)
def test_every_grpc_open_is_refused_naming_its_field_or_opens_within_the_bounds(
    engine, height, width, clip, scaling, request_id
):
    """The gRPC SessionOpen's own types (int32, double, string) through the servicer's request_map."""
    proto = decode_pb2.SessionOpen(height=height, width=width, clip_latent_frames=clip, request_id=request_id)
    if scaling is not None:
        proto.scaling_factor = scaling
    kind, fields = request_map(decode_pb2.SessionRequest(open=proto))
    assert kind == "open"
    try:
        session = opening(engine, fields)
    except InvalidInput as err:
        fields = ("height", "width", "clip_latent_frames", "scaling_factor", "request_id")
        assert err.field in fields or (isinstance(err, LimitExceeded) and err.field == "latents"), str(err)
        return
    assert_within_bounds(engine, session.settings)


NAN, INF = float("nan"), float("inf")
CASES = [
    # sizes: past the pixels a chunk may decode to (413), before a meta tensor is made
    ({"height": 10**9, "width": 10**9}, LimitExceeded, "height", "at most 65536"),
    ({"height": 10**9}, LimitExceeded, "height", "at most 65536"),
    ({"width": 10**9}, LimitExceeded, "width", "at most 65536"),
    ({"height": 2**70}, LimitExceeded, "height", "at most 65536"),
    ({"height": 1000, "width": 1000}, LimitExceeded, "height", "max_output_pixels"),
    ({"width": 50000}, LimitExceeded, "width", "max_output_pixels"),
    ({"height": "16"}, InvalidInput, "height", "a positive integer"),
    ({"height": [3]}, InvalidInput, "height", "a positive integer"),
    ({"height": None}, InvalidInput, "height", "a positive integer"),
    ({"height": 3.0}, InvalidInput, "height", "a positive integer"),
    ({"width": True}, InvalidInput, "width", "a positive integer"),
    ({"width": -3}, InvalidInput, "width", "a positive integer"),
    ({"width": 0}, InvalidInput, "width", "a positive integer"),
    # the clip's length: a hint, bounded
    ({"clip_latent_frames": 10**18}, InvalidInput, "clip_latent_frames", "1048576"),
    ({"clip_latent_frames": 2**20 + 1}, InvalidInput, "clip_latent_frames", "1048576"),
    ({"clip_latent_frames": 0}, InvalidInput, "clip_latent_frames", "a positive integer"),
    ({"clip_latent_frames": -5}, InvalidInput, "clip_latent_frames", "a positive integer"),
    ({"clip_latent_frames": 8.0}, InvalidInput, "clip_latent_frames", "a positive integer"),
    ({"clip_latent_frames": "8"}, InvalidInput, "clip_latent_frames", "a positive integer"),
    ({"clip_latent_frames": False}, InvalidInput, "clip_latent_frames", "a positive integer"),
    # the factors: finite, and within what the chunks' dtype holds (with its reciprocal)
    ({"scaling_factor": NAN}, InvalidInput, "scaling_factor", "finite"),
    ({"scaling_factor": INF}, InvalidInput, "scaling_factor", "finite"),
    ({"scaling_factor": -INF}, InvalidInput, "scaling_factor", "finite"),
    ({"scaling_factor": 1e-300}, InvalidInput, "scaling_factor", "float32"),
    ({"scaling_factor": -1e-300}, InvalidInput, "scaling_factor", "float32"),
    ({"scaling_factor": 5e-324}, InvalidInput, "scaling_factor", "float32"),
    ({"scaling_factor": 1e300}, InvalidInput, "scaling_factor", "float32"),
    ({"scaling_factor": 1e-5, "dtype": "float16"}, InvalidInput, "scaling_factor", "float16"),
    ({"scaling_factor": 0}, InvalidInput, "scaling_factor", "0"),
    ({"scaling_factor": "0.5"}, InvalidInput, "scaling_factor", "a number"),
    ({"scaling_factor": True}, InvalidInput, "scaling_factor", "a number"),
    ({"shift_factor": NAN}, InvalidInput, "shift_factor", "finite"),
    ({"shift_factor": -INF}, InvalidInput, "shift_factor", "finite"),
    ({"shift_factor": 1e300}, InvalidInput, "shift_factor", "float32"),
    ({"shift_factor": 70000.0, "dtype": "float16"}, InvalidInput, "shift_factor", "float16"),
    ({"shift_factor": [0.1]}, InvalidInput, "shift_factor", "a number"),
    # text fields
    ({"request_id": "x" * 5000}, InvalidInput, "request_id", "at most 256 characters"),
    ({"request_id": "x" * 257}, InvalidInput, "request_id", "at most 256 characters"),
    ({"request_id": 5}, InvalidInput, "request_id", "a string"),
    ({"request_id": b"id"}, InvalidInput, "request_id", "a string"),
    ({"model": "m" * 5000}, InvalidInput, "model", "at most 256 characters"),
    ({"model": 5}, InvalidInput, "model", "a string"),
    ({"quality": None}, InvalidInput, "quality", "None"),
    ({"quality": ["high"]}, InvalidInput, "quality", "high"),
    ({"output": {}}, InvalidInput, "output", "{}"),
    ({"dtype": ["float32"]}, InvalidInput, "dtype", "float32"),
    ({"dtype": None}, InvalidInput, "dtype", "None"),
]


@pytest.mark.parametrize("fields, error, field, text", CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_hostile_opens_are_refused_naming_the_field(engine, fields, error, field, text):
    with pytest.raises(InvalidInput) as err:
        opening(engine, {"height": 3, "width": 5, **fields})
    assert type(err.value) is error and err.value.field == field, str(err.value)
    assert text in str(err.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"clip_latent_frames": 2**20},
        {"request_id": "r" * 256},
        {"scaling_factor": 1e-30},
        {"scaling_factor": 1.6e-5, "dtype": "float16"},
        {"shift_factor": -65504.0, "dtype": "float16"},
        {"scaling_factor": None, "shift_factor": 0.0},
        {"height": 3, "width": 723},  # a chunk of 8 latent frames: 29 frames of 24x5784 pixels
    ],
)
def test_opens_at_the_bounds_are_taken(engine, fields):
    assert_within_bounds(engine, opening(engine, {"height": 3, "width": 5, **fields}).settings)


# ---- chunks and messages -------------------------------------------------------------------------
def test_an_empty_chunk_is_refused_naming_latents_by_the_server_and_the_client():
    settings = SessionOpen(3, 5)
    empty = {"dtype": "float32", "shape": [1, 4, 0, 3, 5], "data": b""}
    with pytest.raises(InvalidInput) as wire:
        chunk_request({"latents": empty, "latent_frame": 0}, settings)
    with pytest.raises(InvalidInput) as handle:
        chunk_of(torch.zeros(1, 4, 0, 3, 5), settings)
    for err in (wire.value, handle.value):
        assert type(err) is InvalidInput and err.field == "latents" and "empty chunk" in str(err)
    for latents in (np.zeros((1, 4, 0, 3, 5), np.float32), torch.zeros(1, 4, 0, 3, 5)):
        with pytest.raises(InvalidRequest) as client:
            chunk_fields(latents, 0, {"height": 3, "width": 5, "dtype": "float32"})
        assert client.value.field == "latents" and "empty chunk" in str(client.value)
        assert "dtype" not in str(client.value)


def test_a_session_message_over_max_request_bytes_is_413_naming_latents():
    message = pack({"chunk": {"latents": {"dtype": "float32", "shape": [1, 4, 1, 3, 64], "data": bytes(3072)}}})
    with pytest.raises(LimitExceeded) as err:
        parse_message(message, len(message) - 1)
    assert err.value.field == "latents" and "max_request_bytes" in str(err.value)
    assert parse_message(message, len(message))[0] == "chunk"


def test_grpc_client_refuses_an_open_value_its_message_cannot_carry_naming_the_field():
    for key, value in (("clip_latent_frames", 10**18), ("height", 2**31), ("width", "5")):
        with pytest.raises(InvalidRequest) as err:
            request_proto({"open": {"height": 3, "width": 5, key: value}})
        assert err.value.field == key


# ---- the bearer token: the scheme in any case (RFC 7235), the token compared as before --------------
@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(token_file, scheme):
    admission = Admission(1024, 1.0, auth_token_file=token_file)
    admission.check(f"{scheme} {TOKEN}")
    for wrong in (f"{scheme} wrong", f"{scheme} {TOKEN}x", f"{scheme}{TOKEN}", f"Basic {TOKEN}", TOKEN, ""):
        with pytest.raises(Unauthenticated) as err:
            admission.check(wrong)
        assert err.value.field == "Authorization"


# ---- the proxy guard: a WebSocket handshake without the token is refused before the upgrade ---------
class Recorder:
    def __init__(self):
        self.sent: list[dict] = []
        self.called = False

    async def app(self, scope, receive, send):
        self.called = True
        await receive()
        await send({"type": "websocket.accept"})

    async def send(self, message):
        self.sent.append(message)


async def _receive():
    return {"type": "websocket.connect"}


def _socket_scope(authorization: str | None, denial: bool = True) -> dict:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    extensions = {"websocket.http.response": {}} if denial else {}
    return {"type": "websocket", "path": "/sessions-app/sessions", "headers": headers, "extensions": extensions}


def _handshake(token_file: str, authorization: str | None, denial: bool = True) -> Recorder:
    """A WebSocket scope through the guard (in front of a Recorder); what the guard sent and did."""
    recorder = Recorder()
    guard = ProxyGuard(recorder.app, Admission(1024, 1.0, auth_token_file=token_file))
    asyncio.run(guard(_socket_scope(authorization, denial), _receive, recorder.send))
    return recorder


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", TOKEN])
def test_the_guard_refuses_a_websocket_without_the_token_with_401_before_the_upgrade(token_file, authorization):
    recorder = _handshake(token_file, authorization)
    assert not recorder.called
    start, body = recorder.sent
    assert start["type"] == "websocket.http.response.start" and start["status"] == 401
    assert (b"www-authenticate", b"Bearer") in start["headers"]
    error = json.loads(body["body"])["error"]
    assert (error["type"], error["field"]) == ("unauthenticated", "Authorization")
    # a server without the denial extension: a close before the accept (its handshake's 403)
    recorder = _handshake(token_file, authorization, denial=False)
    assert not recorder.called and recorder.sent == [{"type": "websocket.close", "code": 1008, "reason": ""}]
    # with the token (any case of the scheme): the replica gets the handshake
    for scheme in ("Bearer", "bearer"):
        recorder = _handshake(token_file, f"{scheme} {TOKEN}")
        assert recorder.called and recorder.sent == [{"type": "websocket.accept"}]


async def _echo_sizes(scope, receive, send):
    """A WebSocket app answering each binary message with its size."""
    assert scope["type"] == "websocket"
    await receive()
    await send({"type": "websocket.accept"})
    while (message := await receive())["type"] == "websocket.receive":
        await send({"type": "websocket.send", "bytes": str(len(message.get("bytes") or b"")).encode()})


@pytest.fixture(scope="module")
def guarded_server(token_file):
    """uvicorn, configured as Serve's proxy configures it (its Config through sized_uvicorn), serving
    the guard in front of _echo_sizes; max_request_bytes 16 MiB, uvicorn's own default message limit."""
    admission = Admission(16 * 2**20, 1.0, auth_token_file=token_file)
    port = free_port()
    config = sized_uvicorn(uvicorn, websocket_message_limit(admission.max_request_bytes)).Config(
        ProxyGuard(_echo_sizes, admission), host="127.0.0.1", port=port, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"ws://127.0.0.1:{port}/app/sessions"
    server.should_exit = True
    thread.join(10)


def test_a_real_websocket_handshake_without_the_token_gets_401_not_101(guarded_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(guarded_server, additional_headers=headers, open_timeout=10).close()
        response = refused.value.response
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(response.body)["error"]["field"] == "Authorization"
    with connect(guarded_server, additional_headers={"Authorization": f"BEARER {TOKEN}"}, open_timeout=10) as ws:
        ws.send(b"abc")
        assert ws.recv(timeout=10) == b"3"


def test_the_proxy_lets_a_websocket_message_over_max_request_bytes_through_to_the_replica(guarded_server):
    """A message over max_request_bytes (here 16 MiB, uvicorn's default limit) reaches the app, whose
    bounded parse answers 413; one over twice the bound is closed with 1009 by the proxy itself."""
    with connect(guarded_server, additional_headers={"Authorization": f"Bearer {TOKEN}"}, open_timeout=10) as ws:
        ws.send(bytes(16 * 2**20 + 1))
        assert ws.recv(timeout=60) == str(16 * 2**20 + 1).encode()
        ws.send(bytes(32 * 2**20 + 1))
        with pytest.raises(ConnectionClosedError) as closed:
            ws.recv(timeout=60)
        assert closed.value.rcvd.code == 1009


def test_an_open_with_a_string_over_the_decode_walks_bound_names_its_field():
    """The /decode walk refuses strings over 1024 characters naming `body`; an open names the field."""
    for key in ("request_id", "model", "quality"):
        kind, fields = parse_message(pack({"open": {"height": 3, "width": 5, key: "x" * 5000}}), 2**20)
        with pytest.raises(InvalidInput) as err:
            session_open(fields)
        assert kind == "open" and err.value.field == key
    with pytest.raises(InvalidInput) as err:  # anything else: the walk's answer stands
        parse_message(pack({"chunk": {"latent_frame": 0, "x": "y" * 5000}}), 2**20)
    assert err.value.field == "body"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, "session"),
        ({"session": 7}, "session"),
        ({"session": ""}, "session"),
        ({"session": "r." + "x" * 300}, "session"),
        ({"session": "r.1", "latent_frames": -1}, "latent_frames"),
        ({"session": "r.1", "latent_frames": True}, "latent_frames"),
        ({"session": "r.1", "latent_frames": "3"}, "latent_frames"),
        ({"session": "r.1", "extra": 1}, "extra"),
        ("not a map", "attach"),
    ],
)
def test_hostile_attaches_are_refused_naming_the_field(fields, field):
    from vae_service.protocol.sessions import session_attach

    with pytest.raises(InvalidInput) as refused:
        session_attach(fields)
    assert refused.value.field == field


@pytest.mark.parametrize("received", [None, 0, 9])
def test_an_attach_reads_its_session_and_what_the_client_received(received):
    from vae_service.protocol.sessions import session_attach

    fields = {"session": "replica.abc"} | ({} if received is None else {"latent_frames": received})
    assert session_attach(fields) == ("replica.abc", received)
