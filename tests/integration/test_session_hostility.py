"""Hostile decode-session opens and chunks over the real service, both transports (the WebSocket
/sessions through Serve's HTTP proxy and its guard; gRPC DecodeSession through Serve's gRPC proxy):
each is answered as a typed error naming the field (400 invalid_request, 413 payload_too_large),
the connection ends cleanly (a close frame, a status), and the replicas go on decoding sessions."""

import grpc
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.session_wire import C, H, W, chunk_answer, latents, receive, send, ws_url
from vae_service_client import InvalidRequest, VaeClient, VaeGrpcClient
from vae_service_client.grpc_gen import decode_pb2, decode_pb2_grpc
from vae_service_client.messages import pack

pytestmark = pytest.mark.integration
APPLICATION = (("application", "sessions"),)
MAX_REQUEST_BYTES = 64 * 2**20  # the sessions app's limits.max_request_bytes (the default)


def open_refused(url: str, fields: dict) -> dict:
    """An open over the WebSocket: its error, after which the server closes the connection (1008)."""
    with connect(ws_url(url), open_timeout=60) as ws:
        send(ws, "open", {"height": H, "width": W, **fields})
        message = receive(ws)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=60)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008, closed.value
    return message["error"]


@pytest.mark.parametrize(
    "fields, type_, field",
    [
        ({"height": 10**9}, "payload_too_large", "height"),
        ({"clip_latent_frames": 10**18}, "invalid_request", "clip_latent_frames"),
        ({"scaling_factor": float("nan")}, "invalid_request", "scaling_factor"),
        ({"request_id": "x" * 5000}, "invalid_request", "request_id"),
        ({"dtype": ["float32"]}, "invalid_request", "dtype"),
    ],
)
def test_a_hostile_open_over_the_websocket_is_refused_naming_the_field(sessions_app, fields, type_, field):
    error = open_refused(sessions_app, fields)
    assert (error["type"], error["field"]) == (type_, field), error


@pytest.mark.parametrize(
    "fields, code, type_, field",
    [
        ({"height": 10**9}, grpc.StatusCode.RESOURCE_EXHAUSTED, "payload_too_large", "height"),
        ({"clip_latent_frames": 2**31 - 1}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "clip_latent_frames"),
        ({"scaling_factor": 1e-300}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "scaling_factor"),
        ({"request_id": "x" * 5000}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "request_id"),
    ],
)
def test_a_hostile_open_over_grpc_is_refused_naming_the_field(grpc_target, fields, code, type_, field):
    """The refusal is the stream's last reply and its status, with the error's trailers."""
    request = decode_pb2.SessionRequest(open=decode_pb2.SessionOpen(**{"height": H, "width": W, **fields}))
    with grpc.insecure_channel(grpc_target) as channel:
        call = decode_pb2_grpc.VaeDecoderStub(channel).DecodeSession(iter([request]), metadata=APPLICATION)
        replies = []
        with pytest.raises(grpc.RpcError) as status:
            for reply in call:
                replies.append(reply)
    errors = [r.error for r in replies if r.WhichOneof("kind") == "error"]
    assert [(e.type, e.field) for e in errors] == [(type_, field)], replies
    assert status.value.code() == code
    trailers = dict(status.value.trailing_metadata() or ())
    assert (trailers.get("error-type"), trailers.get("error-field")) == (type_, field)


def test_an_empty_chunk_is_refused_naming_latents_and_the_session_goes_on(sessions_app, grpc_target):
    with connect(ws_url(sessions_app), open_timeout=60) as ws:  # the server's own refusal
        send(ws, "open", {"height": H, "width": W})
        assert "opened" in receive(ws)
        empty = {"dtype": "float32", "shape": [1, C, 0, H, W], "data": b""}
        send(ws, "chunk", {"latents": empty, "latent_frame": 0})
        error = receive(ws)["error"]
        assert (error["type"], error["field"]) == ("invalid_request", "latents") and "empty chunk" in error["message"]
        frames, done = chunk_answer(ws, latents(1, 0), 0)
        assert done["chunk_done"]["latent_frames"] == 1 and frames
    for client in (VaeClient(sessions_app), VaeGrpcClient(grpc_target, application="sessions")):  # the clients'
        with client, client.session(H, W) as session:
            with pytest.raises(InvalidRequest) as refused:
                session.decode(np.zeros((1, C, 0, H, W), np.float32))
            assert refused.value.field == "latents" and "empty chunk" in str(refused.value)
            assert session.decode(latents(1, 1)).latent_frames == 1


def test_a_message_over_max_request_bytes_is_413_naming_latents_and_the_session_goes_on(sessions_app):
    """Over the bound (and over uvicorn's own 16 MiB default): the replica's bounded parse answers,
    not the proxy's WebSocket layer (which would close with 1009 and lose the session)."""
    t = MAX_REQUEST_BYTES // (C * H * W * 4) + 16
    big = {"dtype": "float32", "shape": [1, C, t, H, W], "data": bytes(C * t * H * W * 4)}
    message = pack({"chunk": {"latents": big, "latent_frame": 0}})
    assert MAX_REQUEST_BYTES < len(message) < 2 * MAX_REQUEST_BYTES
    with connect(ws_url(sessions_app), open_timeout=60) as ws:
        send(ws, "open", {"height": H, "width": W})
        assert "opened" in receive(ws)
        ws.send(message)
        error = receive(ws, timeout=120)["error"]
        assert (error["type"], error["field"]) == ("payload_too_large", "latents"), error
        assert "max_request_bytes" in error["message"]
        frames, done = chunk_answer(ws, latents(1, 2), 0)
        assert done["chunk_done"]["latent_frames"] == 1 and frames


def test_after_the_hostile_opens_every_replica_still_decodes_sessions(sessions_app, grpc_target):
    for fields in ({"height": 10**9}, {"clip_latent_frames": 10**18}, {"scaling_factor": float("inf")}):
        open_refused(sessions_app, fields)
    owners: set[str] = set()
    for attempt in range(40):  # a session lands on the replica the proxy picks: until both answered
        with VaeClient(sessions_app) as client, client.session(H, W, clip_latent_frames=2) as session:
            first, second = session.decode(latents(1, attempt)), session.decode(latents(1, attempt + 1))
            assert (first.frames, second.frame) == (1, 1) and second.frames > 0
            owners.add(session.session_id.split(".", 1)[0])
        if len(owners) == 2:
            break
    assert len(owners) == 2, owners
    with VaeGrpcClient(grpc_target, application="sessions") as client, client.session(H, W) as session:
        assert session.decode(latents(2, 7)).latent_frames == 2
