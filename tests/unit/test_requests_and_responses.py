"""protocol/requests.py and protocol/responses.py: every way in gives the same engine request, the
latent factors' three states (key absent or the client's UNSET: the model's own; nil: already
scaled; a number: replaces the model's) mapped alike over msgpack, gRPC and handles; every way out
carries the result's fields."""

import pickle

import msgpack
import numpy as np
import pytest
import torch

from tests.models import reference_decode
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, DecodeResult, Timing
from vae_service.engine.execution.video import FrameChunk
from vae_service.protocol.requests import parse_decode_body, request_from_call, request_from_proto
from vae_service.protocol.responses import (
    grpc_frame_message,
    grpc_item_responses,
    grpc_response,
    handle_frame_message,
    handle_response,
    msgpack_response,
)
from vae_service_client.frames import StreamSummary, chunk_of, message_of_proto
from vae_service_client.grpc_gen import decode_pb2
from vae_service_client.messages import MSGPACK, UNSET, DecodeResponse, pack, request_map, request_proto
from vae_service_client.mp4 import Mp4Fragment

Z = torch.randn(1, 4, 2, 2)


def over_msgpack(**kw) -> DecodeRequest:
    return parse_decode_body(pack(request_map(Z, **kw)), MSGPACK, Limits().max_request_bytes)


def over_grpc(**kw) -> DecodeRequest:
    wire = request_proto(Z, **kw).SerializeToString()
    return request_from_proto(decode_pb2.DecodeRequest.FromString(wire))


def over_handle(**kw) -> DecodeRequest:
    # arguments cross a Ray handle pickled: the client's UNSET must arrive as itself
    return request_from_call(Z, **pickle.loads(pickle.dumps(kw)))


# (factors sent) -> (scaling_factor, shift_factor, latents_scaled) of the engine's request
FACTOR_CASES = [
    ({}, (None, None, False)),
    ({"scaling_factor": UNSET, "shift_factor": UNSET}, (None, None, False)),
    ({"scaling_factor": None}, (None, None, True)),
    ({"shift_factor": None}, (None, None, True)),
    ({"scaling_factor": None, "shift_factor": None}, (None, None, True)),
    ({"scaling_factor": 0.5}, (0.5, None, False)),
    ({"scaling_factor": 0.5, "shift_factor": -1.0}, (0.5, -1.0, False)),
    ({"scaling_factor": 0.5, "shift_factor": None}, (0.5, None, True)),
    ({"scaling_factor": None, "shift_factor": 0.25}, (None, 0.25, True)),
]


@pytest.mark.parametrize("way_in", [over_msgpack, over_grpc, over_handle], ids=["msgpack", "grpc", "handle"])
@pytest.mark.parametrize("sent, expected", FACTOR_CASES)
def test_factors_map_alike_over_every_way_in(way_in, sent, expected):
    request = way_in(**sent)
    assert (request.scaling_factor, request.shift_factor, request.latents_scaled) == expected


@pytest.mark.parametrize("way_in", [over_msgpack, over_grpc, over_handle], ids=["msgpack", "grpc", "handle"])
def test_the_other_fields_arrive_alike(way_in):
    request = way_in(quality="high", output="float", height=16, width=24, request_id="r", model="m")
    assert (request.quality, request.output, request.height, request.width) == ("high", "float", 16, 24)
    assert (request.request_id, request.model, request.stream) == ("r", "m", False)
    assert torch.equal(request.latents, Z)


@pytest.mark.parametrize("way_in", [over_msgpack, over_grpc, over_handle], ids=["msgpack", "grpc", "handle"])
@pytest.mark.parametrize("tiling", ["auto", "model", "none"])
def test_the_requests_tiling_arrives_alike(way_in, tiling):
    assert way_in(tiling=tiling).tiling == tiling
    assert way_in().tiling == "auto"  # not sent: the bound decides


def test_decode_frames_requests_stream():
    assert request_from_proto(request_proto(Z), stream=True).stream


@pytest.fixture(scope="module")
def flux_engine(flux_dir):
    return DecodeEngine(ServiceConfig(model=str(flux_dir), model_name="flux", device="cpu"))


@pytest.mark.parametrize(
    "sent, latents_in",
    [
        ({}, lambda z, vae: z / vae.config.scaling_factor + vae.config.shift_factor),  # the model's own
        ({"scaling_factor": None}, lambda z, vae: z),  # already scaled: no shift either
        ({"scaling_factor": 0.5}, lambda z, vae: z / 0.5 + vae.config.shift_factor),  # one replaced
        ({"scaling_factor": None, "shift_factor": 0.25}, lambda z, vae: z + 0.25),  # scaled, then shifted
    ],
)
def test_what_the_engine_makes_of_each_state(flux_engine, flux_reference, sent, latents_in):
    """FLUX has both factors, so each state decodes differently."""
    z = torch.randn(1, 8, 2, 3, generator=torch.Generator().manual_seed(7))
    request = request_from_call(z, output="float", **sent)
    (result,) = flux_engine.decode([flux_engine.prepare(request)])
    assert torch.equal(result.output, reference_decode(flux_reference, latents_in(z, flux_reference)))


# ---- responses ---------------------------------------------------------------------------------
def result(output=None, retried_from_frame=None) -> DecodeResult:
    return DecodeResult(
        output=output,
        model="m",
        precision="fp32",
        quality="high",
        request_id="r",
        timing=Timing(queue_ms=1.0, decode_ms=2.0, batch_size=3, encode_ms=0.5),
        tiled=True,
        retried_from_frame=retried_from_frame,
        fallback=(0, 2),
    )


SUMMARY = {
    "model": "m",
    "quality": "high",
    "precision": "fp32",
    "request_id": "r",
    "timing": {
        "queue_ms": 1.0,
        "decode_ms": 2.0,
        "encode_ms": 0.5,
        "batch_size": 3,
        "replicas": 1,
        "preempted_ms": 0.0,
    },
    "tiled": True,
    "fallback": [0, 2],
}


def test_whole_answers_over_msgpack_grpc_and_handles_carry_the_same_fields():
    pixels = torch.arange(2 * 2 * 3 * 3, dtype=torch.uint8).reshape(2, 2, 3, 3)
    via_msgpack = DecodeResponse.from_map(msgpack.unpackb(msgpack_response(result(pixels)), raw=False))
    via_grpc = DecodeResponse.from_proto(grpc_response(result(pixels)))
    via_handle = handle_response(result(pixels))
    for response in (via_msgpack, via_grpc):
        assert response.summary() == SUMMARY
        np.testing.assert_array_equal(response.output, pixels.numpy())
    assert {k: via_handle[k] for k in SUMMARY} == SUMMARY
    np.testing.assert_array_equal(via_handle["output"], pixels.numpy())


@pytest.mark.parametrize("output", [torch.zeros(3, 2, 2, 3, dtype=torch.uint8), [b"a", b"b", b"c"]])
def test_decode_stream_answers_one_message_per_item_in_order(output):
    messages = [DecodeResponse.from_proto(m) for m in grpc_item_responses(result(output))]
    assert [m.item_index for m in messages] == [0, 1, 2]
    assert all(m.summary() == SUMMARY for m in messages)
    if isinstance(output, list):
        assert [m.output for m in messages] == [[b"a"], [b"b"], [b"c"]]
    else:
        assert all(m.output.shape == (1, 2, 2, 3) for m in messages)


@pytest.mark.parametrize("retried_from_frame", [None, 0, 5])
def test_decode_frames_messages_are_a_chunk_or_done(retried_from_frame):
    pixels = torch.rand(2, 3, 4, 2, 2)  # float frames [n, 3, t, H, W]
    chunk = grpc_frame_message(FrameChunk(1, 5, pixels))
    assert chunk.WhichOneof("kind") == "chunk"
    read = message_of_proto(decode_pb2.FrameMessage.FromString(chunk.SerializeToString()))
    assert (read["item"], read["frame"]) == (1, 5)
    assert read["pixels"]["shape"] == [2, 3, 4, 2, 2]

    done = grpc_frame_message(result(retried_from_frame=retried_from_frame))
    assert done.WhichOneof("kind") == "done"
    expected = {**SUMMARY, **({} if retried_from_frame is None else {"retried_from_frame": retried_from_frame})}
    assert message_of_proto(decode_pb2.FrameMessage.FromString(done.SerializeToString())) == {"done": expected}


def test_an_mp4_streams_fragments_cross_grpc_and_handles_as_bytes():
    fragment = Mp4Fragment(5, 4, b"\x00\x00\x00\x08moof")
    read = message_of_proto(decode_pb2.FrameMessage.FromString(grpc_frame_message(fragment).SerializeToString()))
    assert read == {"item": 0, "frame": 5, "frames": 4, "fragment": fragment.data}
    assert handle_frame_message(fragment) == read
    summary = StreamSummary()
    assert chunk_of(read, summary) == Mp4Fragment(5, 4, fragment.data) and not summary.fields


def test_the_empty_message_that_carries_a_stream_error_reads_as_nothing():
    from vae_service_client.grpc_client import carries_something

    assert message_of_proto(decode_pb2.FrameMessage()) is None
    assert not carries_something(decode_pb2.FrameMessage()) and not carries_something(decode_pb2.DecodeResponse())
    assert carries_something(grpc_frame_message(FrameChunk(0, 0, torch.zeros(1, 1, 1, 1, 3, dtype=torch.uint8))))
