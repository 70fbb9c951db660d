"""Bearer-token authentication on the real local Serve: HTTP routes, gRPC, the routing ingress;
the token from a file or from the environment."""

import json

import grpc
import httpx
import numpy as np
import pytest
import torch
from ray import serve
from websockets.sync.client import connect

from tests.integration.conftest import TEST_DEPLOYMENT
from tests.session_wire import receive, send, ws_url
from vae_service.serving.app import decoder_app, multi_model_app
from vae_service.serving.scheduling.admission import TOKEN_ENV
from vae_service_client import Unauthenticated, VaeClient, VaeGrpcClient
from vae_service_client.grpc_gen import decode_pb2_grpc
from vae_service_client.messages import MSGPACK, pack, request_map, request_proto

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token"


@pytest.fixture(scope="module", params=["file", "environment"])
def secured(request, ray_cluster, kl_dir, tmp_path_factory):
    """(url, gRPC application) of a single-model app and of a routed one, both behind TOKEN."""
    config = {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1}
    options = dict(TEST_DEPLOYMENT)
    if request.param == "file":
        token_file = tmp_path_factory.mktemp("auth") / "token"
        token_file.write_text(TOKEN + "\n")
        config["auth_token_file"] = str(token_file)
    else:
        options["ray_actor_options"] = {"runtime_env": {"env_vars": {TOKEN_ENV: TOKEN}}}
    serve.run(decoder_app(config, **options), name="locked", route_prefix="/locked")
    apps = [("locked", f"{ray_cluster}/locked")]
    if request.param == "file":  # the router reads the same file
        serve.run(multi_model_app({"models": [config]}, **options), name="lockedr", route_prefix="/lockedr")
        apps.append(("lockedr", f"{ray_cluster}/lockedr"))
    yield apps
    for name, _ in apps:
        serve.delete(name)


def test_http_routes_require_the_token_and_refuse_missing_and_wrong_alike(secured, ray_cluster):
    body = pack(request_map(torch.zeros(1, 4, 2, 2)))
    for _, url in secured:
        answers = [
            httpx.post(f"{url}/decode", content=body, headers={"content-type": MSGPACK, **auth})
            for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN})
        ]
        for r in answers:
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "unauthenticated" and r.json()["error"]["field"] == "Authorization"
        assert len({r.content for r in answers}) == 1  # nothing tells a missing token from a wrong one
        for path in ("/health", "/remote-decode?shape=1&shape=4&shape=2&shape=2"):
            method = httpx.get if path == "/health" else httpx.post
            assert method(f"{url}{path}").status_code == 401
        with VaeClient(url, token=TOKEN) as client:
            assert client.health()["auth"] == "bearer"
            assert client.decode(np.zeros((1, 4, 2, 2), np.float32)).output.shape == (1, 16, 16, 3)
        with VaeClient(url) as client, pytest.raises(Unauthenticated) as err:
            client.decode(np.zeros((1, 4, 2, 2), np.float32))
        assert (err.value.status, err.value.field) == (401, "Authorization")
    assert httpx.get(f"{ray_cluster}/-/healthz").status_code == 200  # Serve's liveness probe needs no token


def test_grpc_requires_the_token(secured, grpc_target):
    for application, _ in secured:
        with VaeGrpcClient(grpc_target, application=application, token=TOKEN) as client:
            assert client.decode(torch.zeros(1, 4, 2, 2)).output.shape == (1, 16, 16, 3)
        wrong = VaeGrpcClient(grpc_target, application=application, token="wrong", retries=0)
        with wrong, pytest.raises(Unauthenticated) as err:
            wrong.decode(torch.zeros(1, 4, 2, 2))
        assert err.value.field == "Authorization"
        with grpc.insecure_channel(grpc_target) as channel:
            stub = decode_pb2_grpc.VaeDecoderStub(channel)
            with pytest.raises(grpc.RpcError) as raw:
                stub.Decode(request_proto(np.zeros((1, 4, 2, 2), np.float32)), metadata=(("application", application),))
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_bearer_scheme_is_case_insensitive_over_http_and_the_websocket(secured):
    """RFC 7235: `bearer` and `BEARER` are the scheme as well as `Bearer` (the token itself exact)."""
    body = pack(request_map(torch.zeros(1, 4, 2, 2)))
    for _, url in secured:
        for scheme in ("bearer", "BEARER"):
            answer = httpx.post(
                f"{url}/decode", content=body, headers={"content-type": MSGPACK, "authorization": f"{scheme} {TOKEN}"}
            )
            assert answer.status_code == 200, answer.text
    # the single-model app's /sessions: past the token, its open is answered (tiny-kl has no causal decoder)
    with connect(ws_url(secured[0][1]), additional_headers={"Authorization": f"bearer {TOKEN}"}) as ws:
        send(ws, "open", {"height": 2, "width": 2})
        error = receive(ws)["error"]
    assert (error["type"], error["field"]) == ("invalid_request", "model"), error


def test_a_session_handshake_without_the_token_is_refused_before_the_upgrade(secured):
    """No WebSocket is opened for a caller without the token: the handshake is answered 401 (the
    error's JSON, `WWW-Authenticate: Bearer`), and the client raises Unauthenticated."""
    from websockets.exceptions import InvalidStatus

    url = secured[0][1]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(url), additional_headers=headers)
        response = refused.value.response
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(response.body)["error"]["type"] == "unauthenticated"
    with pytest.raises(Unauthenticated), VaeClient(url).session(2, 2):
        pass
