"""What the clients refuse before sending anything, typed like the server's answers and naming the
argument; and error texts that say where an error came from (HTTP status, gRPC status, the client
itself). Nothing listens on the URL and target used here: a request that went out would fail with
a connection error instead."""

import pickle

import numpy as np
import pytest
import torch

from tests.ports import free_port
from vae_service_client import AsyncVaeClient, InvalidRequest, VaeClient, VaeGrpcClient
from vae_service_client.errors import error_from_grpc, error_from_http, make_error

Z = np.zeros((1, 4, 8, 8), np.float32)


@pytest.fixture
def nowhere():
    return free_port()


def clients(port: int):
    yield VaeClient(f"http://127.0.0.1:{port}", retries=0)
    yield VaeGrpcClient(f"127.0.0.1:{port}", retries=0)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_an_unknown_keyword_is_a_typed_error_naming_it_with_its_close_match(nowhere, kind):
    client = dict(zip(["http", "grpc"], clients(nowhere), strict=True))[kind]
    with pytest.raises(InvalidRequest) as err:
        client.decode(Z, qualty="high")
    exc = err.value
    assert (exc.field, exc.type, exc.status, exc.via) == ("qualty", "invalid_request", 400, "client")
    assert "did you mean 'quality'?" in exc.message and "allowed: quality, output, scaling_factor" in exc.message
    assert str(exc).startswith("invalid_request (client-side, nothing sent): qualty: unknown argument")
    with pytest.raises(InvalidRequest, match="heigth: unknown argument; did you mean 'height'"):
        client.decode_frames(Z, heigth=8)


async def test_the_async_client_refuses_the_same(nowhere):
    async with AsyncVaeClient(f"http://127.0.0.1:{nowhere}", retries=0) as client:
        with pytest.raises(InvalidRequest, match="qualty: unknown argument; did you mean 'quality'"):
            await client.decode(Z, qualty="high")


@pytest.mark.parametrize(
    "latents, dtype",
    [
        (np.zeros((1, 4, 8, 8)), "float64"),  # NumPy's default
        (np.zeros((1, 4, 8, 8), np.uint8), "uint8"),  # a wire dtype of outputs, never of latents
        (np.zeros((1, 4, 8, 8), np.int64), "int64"),
        (torch.zeros(1, 4, 8, 8, dtype=torch.float64), "float64"),
        ([[0.5, 1.5]], "list"),
    ],
)
def test_latents_of_a_dtype_the_service_does_not_decode_are_refused_naming_the_latents_dtypes(nowhere, latents, dtype):
    with VaeClient(f"http://127.0.0.1:{nowhere}", retries=0) as client, pytest.raises(InvalidRequest) as err:
        client.decode(latents)
    exc = err.value
    assert exc.field == "latents.dtype" and exc.via == "client"
    assert exc.message.startswith(f"latents.dtype: {dtype} is not a latents dtype; send float32, float16, bfloat16")
    assert "uint8" not in exc.message.split("send", 1)[1]


def test_error_texts_say_where_the_error_came_from():
    trailers = [("error-type", "invalid_request"), ("error-field", "latents")]
    grpc = error_from_grpc("INVALID_ARGUMENT", "latents: model 'kl' takes 4 dims", trailers)
    assert str(grpc) == "gRPC INVALID_ARGUMENT invalid_request: latents: model 'kl' takes 4 dims"
    assert (grpc.status, grpc.grpc_code, grpc.field, grpc.via) == (400, "INVALID_ARGUMENT", "latents", "grpc")
    bare = error_from_grpc("UNAVAILABLE", "connection refused", ())
    assert str(bare) == "gRPC UNAVAILABLE unavailable: connection refused"
    http = error_from_http(400, {}, b'{"error": {"type": "invalid_request", "field": "x", "message": "x: bad"}}')
    assert str(http) == "HTTP 400 invalid_request: x: bad" and http.grpc_code == "INVALID_ARGUMENT"
    answer = make_error("payload_too_large", "latents", "latents: too big")
    assert str(answer) == "payload_too_large (413): latents: too big"
    for exc in (grpc, http, answer):  # across Ray handles
        again = pickle.loads(pickle.dumps(exc))
        assert (type(again), str(again), again.via, again.grpc_code) == (type(exc), str(exc), exc.via, exc.grpc_code)
