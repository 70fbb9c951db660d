"""Video frames streamed as they are decoded, through Serve with real clients: HTTP (the model's
own ingress and a router in front), gRPC DecodeFrames and a streaming handle; bit-identical to
the whole answer; errors before the first frame as ordinary typed errors. gRPC DecodeStream
keeps one meaning for video models too: one message per batch item."""

import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from vae_service_client import AsyncVaeClient, AsyncVaeGrpcClient, InvalidRequest, VaeClient, VaeGrpcClient
from vae_service_client.frames import FrameStream, assemble
from vae_service_client.grpc_gen import decode_pb2_grpc
from vae_service_client.messages import request_proto

pytestmark = pytest.mark.integration


def latents(batch=2, frames=3, h=3, w=4, seed=0):
    return torch.randn(batch, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("output", ["uint8", "float"])
def test_http_stream_joins_into_the_whole_answer(wan_url, quality, output):
    z = latents()
    with VaeClient(wan_url) as client:
        whole = client.decode(z, quality, output)
        stream = client.decode_frames(z, quality, output, request_id="v1")
        chunks = list(stream)
    assert [c.frame for c in chunks if c.item == 0] == [0, 1, 5]
    np.testing.assert_array_equal(assemble(chunks), whole.output)
    summary = stream.summary
    assert (summary.model, summary.quality, summary.request_id, summary.tiled) == ("wan", quality, "v1", False)
    assert summary.timing["decode_ms"] > 0


async def test_router_streams_http_and_grpc(multi_url, grpc_target):
    z = latents(seed=1)
    async with AsyncVaeClient(multi_url) as http:
        whole = await http.decode(z, "high", model="wan")
        over_http = await http.decode_frames(z, "high", model="wan").collect()
    async with AsyncVaeGrpcClient(grpc_target, application="multi", retries=0) as rpc:
        stream = rpc.decode_frames(z, "high", model="wan")
        over_grpc = [c async for c in stream]
        items = [m async for m in rpc.decode_stream(z, "high", model="wan")]
        with pytest.raises(InvalidRequest, match="served") as err:
            [c async for c in rpc.decode_frames(z, model="nope")]
    np.testing.assert_array_equal(over_http, whole.output)
    np.testing.assert_array_equal(assemble(over_grpc), whole.output)
    assert len(over_grpc) == 3 and stream.summary.model == "wan"
    assert [m.item_index for m in items] == [0, 1]  # DecodeStream through the router: one per item
    np.testing.assert_array_equal(np.concatenate([m.output for m in items]), whole.output)
    assert err.value.field == "model"


def test_grpc_decode_frames_is_one_message_per_chunk_then_done(grpc_target, wan_url):
    z = latents(seed=2)
    with VaeGrpcClient(grpc_target, application="wan") as client:
        stream = client.decode_frames(z, "lossless", "float", request_id="f1")
        chunks = list(stream)
    with grpc.insecure_channel(grpc_target) as channel:
        stub = decode_pb2_grpc.VaeDecoderStub(channel)
        raw = list(stub.DecodeFrames(request_proto(z, output="float"), metadata=(("application", "wan"),), timeout=60))
    whole = VaeClient(wan_url).decode(z, output="float").output
    assert [(c.item, c.frame, c.pixels.shape[2]) for c in chunks] == [
        (item, frame, t) for item in (0, 1) for frame, t in ((0, 1), (1, 4), (5, 4))
    ]
    np.testing.assert_array_equal(assemble(chunks), whole)
    assert (stream.summary.model, stream.summary.request_id, stream.summary.tiled) == ("wan", "f1", False)
    # what any gRPC client sees: six `chunk` messages, then one `done`
    assert [m.WhichOneof("kind") for m in raw] == ["chunk"] * 6 + ["done"]
    assert [(m.chunk.item_index, m.chunk.frame_start) for m in raw[:3]] == [(0, 0), (0, 1), (0, 5)]
    assert raw[-1].done.model == "wan" and raw[-1].done.timing.decode_ms > 0


@pytest.mark.parametrize(
    "app_name, kwargs, field, text",
    [
        ("wan", {"quality": "ultra"}, "quality", "allowed"),
        ("wan", {"output": "jpeg"}, "stream", "not 'jpeg'"),
        ("kl", {}, "stream", "decodes images"),
    ],
)
def test_grpc_decode_frames_errors_are_typed(grpc_target, wan_url, kl_url, app_name, kwargs, field, text):
    z = latents(batch=1) if app_name == "wan" else torch.randn(1, 4, 2, 2)
    client = VaeGrpcClient(grpc_target, application=app_name, retries=0)
    with client, pytest.raises(InvalidRequest, match=text) as err:
        list(client.decode_frames(z, **kwargs))
    assert err.value.field == field and err.value.type == "invalid_request"
    with grpc.insecure_channel(grpc_target) as channel:  # a plain stub: the status, trailers, no frame
        received = []
        with pytest.raises(grpc.RpcError) as raw:
            for message in decode_pb2_grpc.VaeDecoderStub(channel).DecodeFrames(
                request_proto(z, **kwargs), metadata=(("application", app_name),), timeout=60
            ):
                received.append(message)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(raw.value.trailing_metadata())["error-field"] == field
    assert len(received) <= 1 and not any(m.WhichOneof("kind") for m in received)


def test_streaming_handle(ray_cluster, wan_url):
    from ray import serve

    handle = serve.get_app_handle("wan").options(stream=True)
    z = latents(seed=3)
    messages = list(handle.decode_frames.remote(z, quality="high"))
    whole = VaeClient(wan_url).decode(z, "high").output
    assert messages[-1]["done"]["model"] == "wan"
    np.testing.assert_array_equal(FrameStream(messages).collect(), whole)


@pytest.mark.parametrize(
    "url_fixture, kwargs, text",
    [
        ("wan_url", {"output": "png"}, "not 'png'"),
        ("kl_url", {}, "decodes images"),
        ("wan_url", {"quality": "ultra"}, "allowed"),
    ],
)
def test_errors_before_the_first_frame_are_typed_http_errors(request, url_fixture, kwargs, text):
    url = request.getfixturevalue(url_fixture)
    z = latents(batch=1) if url_fixture == "wan_url" else torch.randn(1, 4, 2, 2)
    with VaeClient(url, retries=0) as client, pytest.raises(InvalidRequest, match=text) as err:
        list(client.decode_frames(z, **kwargs))
    assert err.value.status in (400, 422) and err.value.field in ("stream", "quality")


def idle(client: VaeClient, within_s: float = 30.0) -> dict:
    """The replica's /health once nothing is queued or decoding there, waited for up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        health = client.health()
        if health["running_batches"] == 0 and health["queued_items"] == 0:
            return health
        busy = {k: health[k] for k in ("running_batches", "queued_items")}
        assert time.monotonic() < deadline, f"the replica is still busy after {within_s} s: {busy}"
        time.sleep(0.05)


def test_first_frames_arrive_while_the_rest_decodes(wan_url):
    """A streaming server hands the first latent frame's frames over while the rest of the clip is
    still decoding: when they arrive, the replica still has the request's batch on the device and
    has not finished it (a buffering server sends them only after its decode ended)."""
    z = latents(batch=1, frames=12, h=12, w=12, seed=4)
    with VaeClient(wan_url) as client:
        before = idle(client)
        stream = iter(client.decode_frames(z))
        first = next(stream)
        during = client.health()
        rest = list(stream)
        after = client.health()
    assert first.frame == 0 and len(rest) == 11
    assert during["running_batches"] == 1 and during["decoded_items"] == before["decoded_items"]
    assert after["running_batches"] == 0 and after["decoded_items"] == before["decoded_items"] + 1


def test_cli_writes_streamed_frames(wan_url, tmp_path):
    z = latents(batch=1, frames=2, seed=5).numpy()
    np.save(tmp_path / "z.npy", z)
    out = tmp_path / "frames"
    proc = subprocess.run(
        [sys.executable, "-m", "vae_service.cli", "decode", str(tmp_path / "z.npy"), "--url", wan_url,
         "--stream", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "first frames after" in proc.stdout
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files] == [f"z-frame{t:04d}.png" for t in range(5)]
    whole = VaeClient(wan_url).decode(z).output[0]
    np.testing.assert_array_equal(np.stack([np.asarray(Image.open(f)) for f in files]), whole)


def test_a_client_leaving_a_stream_frees_the_replica(wan_url):
    """Leaving after the first frames cancels the request through Serve, and the decode stops at
    its next latent frame. The clip is 16 items of 64 latent frames, decoded item by item: over a
    thousand decoder runs, of which a stop costs one, so the replica only goes idle within the
    bounded wait below if the decode stopped."""
    z, small = latents(batch=16, frames=64, h=10, w=10, seed=6), latents(batch=1, frames=1, seed=7)
    with VaeClient(wan_url) as client:
        expected = client.decode(small).output
        before = idle(client)
        stream = iter(client.decode_frames(z))
        assert next(stream).frame == 0
        assert client.health()["running_batches"] == 1  # the clip is still decoding when the client leaves
        stream.close()  # the client goes away
        after = idle(client)
        again = client.decode(small).output
    assert after["decoded_items"] == before["decoded_items"] + 16  # it reached the device once
    np.testing.assert_array_equal(again, expected)
