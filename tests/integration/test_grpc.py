"""gRPC through Serve's gRPC proxy with a real grpc client."""

import grpc
import numpy as np
import pytest
import torch

from tests.models import reference_decode, torch_threads
from vae_service_client import AsyncVaeGrpcClient, InvalidRequest, PayloadTooLarge, VaeClient, VaeGrpcClient
from vae_service_client.grpc_gen import decode_pb2_grpc
from vae_service_client.messages import request_proto

pytestmark = pytest.mark.integration


def test_unary_decode_matches_http(grpc_target, kl_url, kl_reference):
    z = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(4))
    with VaeGrpcClient(grpc_target, application="kl") as client:
        floats = client.decode(z, output="float", scaling_factor=None, request_id="g1")
        pngs = client.decode(z, output="png")
    assert floats.request_id == "g1" and floats.model == "kl" and floats.timing["batch_size"] >= 2
    with torch_threads(1):
        np.testing.assert_array_equal(floats.output, reference_decode(kl_reference, z).numpy())
    np.testing.assert_array_equal(
        np.stack([np.asarray(im) for im in pngs.images()]), VaeClient(kl_url).decode(z).output
    )


@pytest.mark.parametrize(
    "app_name, z, files",
    [("kl", torch.randn(3, 4, 2, 2), "png"), ("wan", torch.randn(3, 4, 2, 3, 3), "mp4")],
    ids=["image", "video"],
)
def test_decode_stream_is_one_message_per_item_for_every_model(grpc_target, kl_url, wan_url, app_name, z, files):
    """A video model's items carry all their frames: DecodeStream means the same for every model."""
    with VaeGrpcClient(grpc_target, application=app_name) as client:
        for output in ("uint8", "float"):
            items = list(client.decode_stream(z, output=output, request_id="s1"))
            assert [(it.item_index, it.model, it.request_id) for it in items] == [(i, app_name, "s1") for i in range(3)]
            whole = client.decode(z, output=output).output
            np.testing.assert_array_equal(np.concatenate([it.output for it in items]), whole)
        encoded = list(client.decode_stream(z, output=files))
    assert [(it.item_index, len(it.output)) for it in encoded] == [(0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(latents=torch.randn(1, 3, 2, 2)), InvalidRequest, "latents"),
        (dict(latents=torch.randn(1, 4, 2, 2), quality="ultra"), InvalidRequest, "quality"),
        (dict(latents=torch.randn(17, 4, 1, 1)), PayloadTooLarge, "latents"),
    ],
)
def test_errors_map_to_status_codes_naming_the_field(grpc_target, kwargs, error, field):
    with VaeGrpcClient(grpc_target, application="kl", retries=0) as client, pytest.raises(error) as err:
        client.decode(**kwargs)
    assert err.value.field == field
    assert err.value.type == {InvalidRequest: "invalid_request", PayloadTooLarge: "payload_too_large"}[error]


async def test_async_client_and_routing_by_model(grpc_target, multi_url):
    async with AsyncVaeGrpcClient(grpc_target, application="multi") as client:
        video = await client.decode(torch.randn(1, 4, 2, 4, 4), model="wan")
        items = [m async for m in client.decode_stream(torch.randn(2, 8, 2, 2), model="flux", output="png")]
        with pytest.raises(InvalidRequest) as err:
            await client.decode(torch.randn(1, 4, 2, 2), model="nope")
    assert video.model == "wan" and video.output.shape == (1, 5, 32, 32, 3)
    assert [(m.item_index, len(m.output)) for m in items] == [(0, 1), (1, 1)]  # files: one message per item
    assert "served: ['flux', 'kl', 'wan']" in err.value.message


def raw_call(target, request, application="kl"):
    """A plain grpc stub: what any gRPC client in any language sees."""
    with grpc.insecure_channel(target) as channel:
        stub = decode_pb2_grpc.VaeDecoderStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Decode(request, metadata=(("application", application),), timeout=60)
    return err.value


@pytest.mark.parametrize(
    "request_args, code, type_, field",
    [
        (
            dict(latents=np.zeros((1, 3, 2, 2), np.float32)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_request",
            "latents",
        ),
        (
            dict(latents=np.zeros((1, 4, 2, 2), np.float32), quality="ultra"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_request",
            "quality",
        ),
        (
            dict(latents=np.full((1, 4, 2, 2), np.nan, np.float32)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_request",
            "latents",
        ),
        (
            dict(latents=np.zeros((17, 4, 1, 1), np.float32)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "payload_too_large",
            "latents",
        ),
    ],
)
def test_raw_status_codes_carry_type_and_field_in_trailers(grpc_target, request_args, code, type_, field):
    err = raw_call(grpc_target, request_proto(**request_args))
    assert err.code() == code
    trailers = dict(err.trailing_metadata())
    assert (trailers["error-type"], trailers["error-field"]) == (type_, field)
    assert err.details().startswith(field)


def test_raw_deadline_exceeded_on_request_timeout(grpc_target, hasty_url):
    err = raw_call(grpc_target, request_proto(np.zeros((1, 4, 64, 64), np.float32)), application="hasty")
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert dict(err.trailing_metadata())["error-type"] == "timeout"
