"""Through Serve with real clients: a streamed mp4 (webm) over HTTP (the model's own ingress and a
router in front), gRPC DecodeFrames and a streaming handle is the whole `mp4` (`webm`) answer byte
for byte, written to a file by the client as it arrives; an fp16 deployment answers an overflowing item with its fp32
decode and says so over HTTP, gRPC and handles, in /health and in its metric."""

import io
import subprocess
import sys
import time
from pathlib import Path

import av
import grpc
import httpx
import numpy as np
import pytest
import torch

from tests.integration.conftest import TEST_DEPLOYMENT
from tests.integration.test_metrics import samples
from tests.models import OVERFLOW_LATENTS, overflowing_vae, save_vae
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service_client import AsyncVaeClient, AsyncVaeGrpcClient, InvalidRequest, VaeClient, VaeGrpcClient
from vae_service_client.grpc_gen import decode_pb2_grpc
from vae_service_client.messages import MSGPACK, pack, request_map, request_proto
from vae_service_client.mp4 import Mp4Fragment

pytestmark = pytest.mark.integration
VENV_BIN = Path(sys.executable).parent


def latents(frames=3, h=3, w=5, seed=0, batch=1):
    return torch.randn(batch, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


def frames_of(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


CONTENT_TYPES = {"mp4": 'video/mp4; codecs="avc1.', "webm": 'video/webm; codecs="vp9"'}


@pytest.mark.parametrize("quality, output", [("lossless", "mp4"), ("high", "mp4"), ("high", "webm")])
def test_http_video_stream_is_written_to_a_file_as_the_whole_answer(wan_url, tmp_path, quality, output):
    z = latents(seed=1)
    path = tmp_path / f"clip.{output}"
    with VaeClient(wan_url) as client:
        whole = client.decode(z, quality, output, request_id="w").output[0]
        summary = client.decode_video(z, path, quality, output=output, request_id="s")
        body = pack(request_map(z, quality, output, stream=True))
        with httpx.stream("POST", f"{wan_url}/decode", content=body, headers={"content-type": MSGPACK}) as r:
            headers = r.headers
            r.read()
    streamed = path.read_bytes()
    assert streamed == whole
    assert len(frames_of(streamed)) == 9
    assert headers["content-type"].startswith(CONTENT_TYPES[output]) and headers["x-vae-stream"] == output
    assert (summary.model, summary.quality, summary.request_id, summary.fallback) == ("wan", quality, "s", [])
    assert summary.timing["encode_ms"] > 0


@pytest.mark.parametrize("output", ["mp4", "webm"])
async def test_router_and_grpc_stream_the_same_bytes(multi_url, grpc_target, tmp_path, output):
    z = latents(seed=2)
    async with AsyncVaeClient(multi_url) as http:
        whole = (await http.decode(z, "high", output, model="wan")).output[0]
        out = io.BytesIO()
        summary = await http.decode_video(z, out, "high", output=output, model="wan")
    async with AsyncVaeGrpcClient(grpc_target, application="multi", retries=0) as rpc:
        over_grpc = io.BytesIO()
        grpc_summary = await rpc.decode_video(z, over_grpc, "high", output=output, model="wan")
    assert out.getvalue() == whole == over_grpc.getvalue()
    assert summary.model == grpc_summary.model == "wan"


def test_grpc_decode_frames_carries_fragments_then_done(grpc_target, wan_url):
    z = latents(4, seed=3)
    with VaeGrpcClient(grpc_target, application="wan") as client:
        whole = client.decode(z, output="mp4").output[0]
        stream = client.decode_frames(z, output="mp4")
        fragments = list(stream)
        with pytest.raises(InvalidRequest, match="one video") as err:
            list(client.decode_frames(latents(batch=2), output="mp4"))
    assert err.value.field == "output"
    assert all(isinstance(f, Mp4Fragment) for f in fragments)
    assert [(f.frame, f.frames) for f in fragments] == [(0, 1), (1, 4), (5, 4), (9, 4)]
    assert b"".join(f.data for f in fragments) == whole and stream.summary.model == "wan"
    with grpc.insecure_channel(grpc_target) as channel:  # what any gRPC client sees
        raw = list(
            decode_pb2_grpc.VaeDecoderStub(channel).DecodeFrames(
                request_proto(z, output="mp4"), metadata=(("application", "wan"),), timeout=60
            )
        )
    assert [m.WhichOneof("kind") for m in raw] == ["chunk"] * 4 + ["done"]
    assert not raw[0].chunk.HasField("tensor") and raw[0].chunk.fragment[4:8] == b"ftyp"


def test_the_cli_writes_a_streamed_mp4_as_it_decodes(wan_url, tmp_path):
    latents_file = tmp_path / "z.npy"
    z = latents(seed=6)
    np.save(latents_file, z.numpy())
    run = subprocess.run(
        [str(VENV_BIN / "vae-service"), "decode", str(latents_file), "--url", wan_url, "--video", "--stream",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "as it decoded" in run.stdout
    assert (tmp_path / "out" / "z.mp4").read_bytes() == VaeClient(wan_url).decode(z, output="mp4").output[0]


def test_streaming_handle_yields_fragments(ray_cluster, wan_url):
    from ray import serve

    z = latents(seed=4)
    handle = serve.get_app_handle("wan").options(stream=True)
    messages = list(handle.decode_frames.remote(z, output="mp4"))
    whole = VaeClient(wan_url).decode(z, output="mp4").output[0]
    assert messages[-1]["done"]["model"] == "wan"
    assert b"".join(m["fragment"] for m in messages[:-1]) == whole


# ---- the fp32 fallback of an fp16 deployment -------------------------------------------------------
@pytest.fixture(scope="module")
def overflow_dir(tmp_path_factory):
    return save_vae(overflowing_vae("kl"), tmp_path_factory.mktemp("overflow-kl"))


@pytest.fixture(scope="module")
def fp16_url(ray_cluster, overflow_dir):
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {"model": str(overflow_dir), "model_name": "kl-fp16", "decode_precision": "fp16", "cpu_threads": 1}
    serve.run(decoder_app(config, **TEST_DEPLOYMENT), name="kl-fp16", route_prefix="/kl-fp16")
    yield f"{ray_cluster}/kl-fp16"
    serve.delete("kl-fp16")


def test_an_overflowing_item_is_answered_in_fp32_over_every_way_in(fp16_url, grpc_target, overflow_dir, metrics_url):
    from ray import serve

    z = torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(5))
    z[1] *= OVERFLOW_LATENTS
    fp32 = DecodeEngine(ServiceConfig(model=str(overflow_dir), decode_precision="fp32", cpu_threads=1))
    reference = fp32.decode([fp32.prepare(DecodeRequest(z))])[0].output.numpy()
    with VaeClient(fp16_url) as client:
        over_http = client.decode(z)
        all_of_it = client.decode(z[1:])
        health = client.health()
    with VaeGrpcClient(grpc_target, application="kl-fp16") as client:
        over_grpc = client.decode(z)
    over_handle = serve.get_app_handle("kl-fp16").decode.remote(z).result()
    for answer in (over_http, over_grpc):
        assert (answer.precision, answer.fallback) == ("fp16", [1])
        np.testing.assert_array_equal(answer.output[1], reference[1])
    assert (over_handle["precision"], over_handle["fallback"]) == ("fp16", [1])
    np.testing.assert_array_equal(over_handle["output"][1], reference[1])
    assert (all_of_it.precision, all_of_it.fallback) == ("fp32", [0])
    fallback = health["precision_fallback"]
    assert fallback["enabled"] and fallback["to"] == "fp32" and fallback["loaded"]
    assert health["memory_plan"]["fallback_bytes"] == fallback["reserved_bytes"] > 0
    deadline = time.monotonic() + 60  # replicas export every 10 s
    while sum(samples(httpx.get(metrics_url).text, "ray_vae_precision_fallbacks", "kl-fp16").values()) < 4:
        assert time.monotonic() < deadline, "vae_precision_fallbacks never counted the 4 items"
        time.sleep(0.5)
