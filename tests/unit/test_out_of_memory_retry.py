"""The out-of-memory retry of an untiled `high` decode: it starts once the failed attempt's
tensors are unreachable, and a stream that was retried after frames went out says from which
frame on they came from the tiled retry (through the public HTTP stream and the client reader)."""

import weakref

import numpy as np
import pytest
import torch

from vae_service.config import Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.wire.http_routes import decode_events
from vae_service_client.frames import STREAM_MEDIA_TYPE, MessageReader, assemble, frame_message_proto, message_of_proto
from vae_service_client.frames import FrameStream as ClientStream
from vae_service_client.messages import MSGPACK, DecodeResponse, pack, request_map


def inject_out_of_memory(module: torch.nn.Module, on_call: int) -> list:
    """`module` raises a device out-of-memory on its `on_call`-th call, once; returns the calls."""
    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == on_call:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    module.register_forward_pre_hook(hook)
    return calls


@pytest.mark.parametrize("kind", ["kl", "wan"])
def test_the_retry_starts_after_the_failed_attempts_activations_are_gone(request, kind):
    folder = request.getfixturevalue(f"{kind}_dir")
    engine = DecodeEngine(ServiceConfig(model=str(folder), model_name=kind, device="cpu", cpu_threads=1))
    activations, alive_when_retried = [], []

    def fail_once_after(module, args, out):  # the failed attempt's activation: `out`, then its callers' locals
        if not activations:
            activations.append(weakref.ref(out))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    def check(module, args):
        if activations and not alive_when_retried:  # the retry's first call
            alive_when_retried.append(activations[0]() is not None)

    attention = engine.vae.decoder.mid_block.attentions[0]  # runs in both tiers' graphs
    attention.register_forward_pre_hook(check)
    attention.register_forward_hook(fail_once_after)
    frames = (2,) if engine.video else ()
    z = torch.randn(1, engine.spec.latent_channels, *frames, 16, 16, generator=torch.Generator().manual_seed(3))
    (result,) = engine.decode([engine.prepare(DecodeRequest(z, quality="high", latents_scaled=True))])
    assert result.tiled and alive_when_retried == [False]


async def streamed(service: DecodeService, z: torch.Tensor) -> ClientStream:
    events = decode_events(service, pack(request_map(z, "high", stream=True, scaling_factor=None)), MSGPACK)
    assert (await anext(events)).media_type == STREAM_MEDIA_TYPE
    return ClientStream(MessageReader().feed(b"".join([d async for d in events])))


async def test_a_stream_retried_in_tiles_names_the_first_retried_frame(wan_dir):
    """Out of memory at the third latent frame: frames 0-4 (latent frames 0 and 1) went out from
    the untiled decode, the rest come from the tiled retry, and the `done` message says so."""
    service = DecodeService(ServiceConfig(model=str(wan_dir), model_name="wan", device="cpu", cpu_threads=1))
    engine = service.engine
    z = torch.randn(2, 4, 4, 16, 16, generator=torch.Generator().manual_seed(8))
    untiled = await streamed(service, z)
    untiled_frames = assemble(list(untiled))
    assert untiled.summary.retried_from_frame is None and not untiled.summary.tiled

    half = engine.peak_bytes(engine.prepare(DecodeRequest(z, quality="high", stream=True, latents_scaled=True))) // 2
    service.apply(LiveConfig(limits=Limits(max_decode_bytes=half)))  # the retry's plan: tiles of half the peak
    try:
        tiled = await streamed(service, z)
        tiled_frames = assemble(list(tiled))
    finally:
        service.apply(LiveConfig())
    assert tiled.summary.tiled and tiled.summary.retried_from_frame is None

    calls = inject_out_of_memory(engine.vae.decoder.mid_block.attentions[0], on_call=3)
    retried = await streamed(service, z)
    frames = assemble(list(retried))
    assert len(calls) > 3 and retried.summary.tiled
    assert retried.summary.retried_from_frame == 5
    assert frames.shape == untiled_frames.shape  # no frame sent twice
    np.testing.assert_array_equal(frames[:, :5], untiled_frames[:, :5])
    np.testing.assert_array_equal(frames[:, 5:], tiled_frames[:, 5:])
    assert not np.array_equal(frames, untiled_frames)  # the two decodes do differ: worth saying


@pytest.mark.parametrize("retried_from_frame", [None, 0, 5])
def test_the_retried_frame_round_trips_through_msgpack_and_grpc(retried_from_frame):
    timing = {"queue_ms": 1.0, "decode_ms": 2.0, "encode_ms": 0.0, "batch_size": 1, "replicas": 1}
    response = DecodeResponse(
        None, "wan", "high", "fp32", "r", timing, tiled=True, retried_from_frame=retried_from_frame
    )
    summary = response.summary()
    assert ("retried_from_frame" in summary) == (retried_from_frame is not None)
    assert DecodeResponse.from_map({"output": [], **summary}).retried_from_frame == retried_from_frame
    over_grpc = message_of_proto(frame_message_proto({"done": summary}))["done"]  # DecodeFrames' `done`
    assert over_grpc == summary
