"""Streams keep their contract when an item falls back to fp32 (issue 41): an fp16 tiny Wan whose
later latent frames overflow sends its first frames from the fp16 decode (each checked finite
before it went out), never takes them back, and passes the fp32 decode's frames on from the first
frame not sent. The frames joined are the answer, bit for bit: the fp16 frames sent, then the
whole answer's (fp32) frames; a streamed mp4 is the whole mp4 encoding of exactly those frames;
and `done` says what decoded them (`fallback_from_frame` per item in `fallback`, `precision` fp32
only where every frame sent was), through the client's readers (HTTP sync and async, gRPC, mp4).
An item that overflows in its first latent frame sends nothing before fp32: its stream is the
whole answer itself. The non-streamed answer is unchanged (all fp32 for an item that fell back).
Test model: tests/models.py's overflowing tiny Wan, tiny shapes (fp16 convs are slow on a CPU)."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.models import OVERFLOW_LATENTS, overflowing_vae, save_vae
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.media.encoding import encode_item
from vae_service.engine.request.result import DecodeResult
from vae_service.protocol.responses import grpc_frame_message, http_frame_message, response_of, video_stream_bytes
from vae_service.serving.decode_service import DecodeService
from vae_service_client.frames import AsyncFrameStream, FrameStream, MessageReader, StreamSummary, message_of_proto
from vae_service_client.grpc_gen import decode_pb2
from vae_service_client.mp4 import Mp4Fragment, write_chunks

FIRST_FP32 = 5  # Wan: latent frames 0 and 1 give frames 0..4; latent frame 2 (frames 5..8) overflows


def config(folder, precision, **extra) -> ServiceConfig:
    return ServiceConfig(model=str(folder), decode_precision=precision, device="cpu", cpu_threads=1, **extra)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_vae(overflowing_vae("wan"), tmp_path_factory.mktemp("overflow-wan-stream"))


@pytest.fixture(scope="module")
def fp16(folder):
    return DecodeService(config(folder, "fp16"))


@pytest.fixture(scope="module")
def fp16_alone(folder):
    """The same fp16 deployment with the fallback off: what its first decode sends before it overflows."""
    return DecodeEngine(config(folder, "fp16", precision_fallback=False))


@pytest.fixture(scope="module")
def fp32(folder):
    return DecodeEngine(config(folder, "fp32"))


def latents(items=1, overflow_from: tuple[int, ...] = (2,), frames=3, seed=0):
    """Item k's latent frames from overflow_from[k] on scaled so that fp16 overflows on them."""
    z = torch.randn(items, 4, frames, 3, 5, generator=torch.Generator().manual_seed(seed))
    for k, first in enumerate(overflow_from):
        z[k, :, first:] *= OVERFLOW_LATENTS
    return z


def whole(engine, z, quality="lossless", output="uint8"):
    return engine.decode([engine.prepare(DecodeRequest(z, quality, output))])[0]


def stream(service: DecodeService, z, quality="lossless", output="uint8") -> list:
    async def events():
        s = await service.submit(lambda: DecodeRequest(z, quality, output, stream=True), z.nbytes)
        return [e async for e in s.events()]

    return asyncio.run(events())


def joined(chunks: list[FrameChunk], items: int) -> torch.Tensor:
    """Each item's frames joined along the frame axis, as a client joins them (float: as float32)."""
    per = [[c for c in chunks if c.item == i] for i in range(items)]
    assert all(c.pixels.shape[0] == 1 for c in chunks)
    axis = chunks[0].frame_axis
    return torch.cat([torch.cat([c.pixels.to(chunks[-1].pixels.dtype) for c in p], axis) for p in per])


def frames(x: torch.Tensor, lo: int, hi: int | None = None) -> torch.Tensor:
    """Frames lo..hi of uint8 [n, t, H, W, 3] or float [n, 3, t, H, W]."""
    return x[:, lo:hi] if x.dtype == torch.uint8 else x[:, :, lo:hi]


def first_decode(fp16_alone: DecodeEngine, z, quality, output, upto_latent: int) -> torch.Tensor:
    """The fp16 decode's frames of z's latent frames before `upto_latent` (causal: as first sent)."""
    return whole(fp16_alone, z[:, :, :upto_latent], quality, output).output


def via_the_clients(events: list) -> tuple[np.ndarray, StreamSummary, np.ndarray, StreamSummary]:
    """The events as the HTTP stream's bytes read by the sync and the async client, and as gRPC
    DecodeFrames messages: every reader joins the same frames and reads the same summary."""
    reader = MessageReader()
    messages = reader.feed(b"".join(http_frame_message(e) for e in events))
    reader.close()
    sync = FrameStream(messages)
    out = sync.collect()

    async def read_async():
        async def feed():
            for m in messages:
                yield m

        s = AsyncFrameStream(feed())
        return await s.collect(), s.summary

    out_async, summary_async = asyncio.run(read_async())
    np.testing.assert_array_equal(out_async, out)
    grpc = FrameStream(
        [
            message_of_proto(decode_pb2.FrameMessage.FromString(grpc_frame_message(e).SerializeToString()))
            for e in events
        ]
    )
    grpc_out = grpc.collect()
    assert grpc.summary.fields == sync.summary.fields == summary_async.fields
    return out, sync.summary, grpc_out, grpc.summary


@pytest.mark.parametrize("quality, output", [("lossless", "uint8"), ("high", "float")])
def test_a_streamed_item_that_falls_back_keeps_the_frames_it_sent(fp16, fp16_alone, fp32, quality, output):
    z = latents()
    *chunks, done = stream(fp16, z, quality, output)
    assert all(isinstance(c, FrameChunk) for c in chunks) and isinstance(done, DecodeResult)
    assert [c.frame for c in chunks] == [0, 1, FIRST_FP32]  # no frame twice, none taken back
    assert done.fallback == (0,) and done.fallback_from_frame == (FIRST_FP32,)
    assert done.precision == "fp16"  # frames 0..4 went out from fp16: not an fp32 answer
    assert done.retried_from_frame == FIRST_FP32

    answer = whole(fp16.engine, z, quality, output)  # the non-streamed answer: all fp32, as before
    assert answer.fallback == (0,) and answer.precision == "fp32" and answer.fallback_from_frame is None
    assert torch.equal(answer.output, whole(fp32, z, "lossless", output).output)
    sent = first_decode(fp16_alone, z, quality, output, upto_latent=2)
    # the answer the stream tells: the fp16 frames sent, then the whole answer's frames, bit for bit
    told = answer.output.clone()
    frames(told, 0, FIRST_FP32).copy_(sent.to(told.dtype))
    streamed = joined(chunks, 1)
    assert streamed.dtype == told.dtype and torch.equal(streamed, told)
    assert torch.equal(frames(streamed, FIRST_FP32), frames(answer.output, FIRST_FP32))
    assert torch.equal(frames(streamed, 0, FIRST_FP32), sent.to(told.dtype))

    out, summary, grpc_out, _ = via_the_clients([*chunks, done])
    np.testing.assert_array_equal(out, told.numpy())
    np.testing.assert_array_equal(grpc_out, told.numpy())
    assert (summary.precision, summary.fallback, summary.fallback_from_frame) == ("fp16", [0], [FIRST_FP32])


def test_the_engine_hands_a_stream_only_fp32_frames_it_had_not_handed_over(fp16):
    """The fp32 decode runs from frame 0 (the causal cache needs it), but only its frames from the
    first one not handed over reach the sink, marked as the fallback's; a whole answer is all fp32."""
    engine, z, got = fp16.engine, latents(seed=5), []
    prepared = replace(engine.prepare(DecodeRequest(z, "lossless", "uint8", stream=True)), sink=got.append)
    (done,) = engine.decode([prepared])
    assert [(c.frame, c.frames, c.precision, c.fallback) for c in got] == [
        (0, 1, "fp16", False),
        (1, 4, "fp16", False),
        (FIRST_FP32, 4, "fp32", True),
    ]
    assert done.output is None and done.fallback == (0,)


def test_every_item_fell_back_is_fp32_only_for_the_frames_that_were(fp16, fp16_alone, fp32):
    """Items decoded alone: item 0 overflows in its first latent frame (nothing sent before fp32),
    item 1 in its third (frames 0..4 sent from fp16). Every item fell back, yet the frames sent are
    not all fp32: `precision` names fp16, `fallback_from_frame` where each item's fp32 frames begin."""
    z = latents(2, overflow_from=(0, 2), seed=1)
    *chunks, done = stream(fp16, z)
    # item 1's fp16 frames as decoded, then the fp32 decodes once the run ended: item 0's, item 1's rest
    assert [(c.item, c.frame) for c in chunks] == [(1, 0), (1, 1), (0, 0), (0, 1), (0, 5), (1, 5)]
    assert done.fallback == (0, 1) and done.fallback_from_frame == (0, FIRST_FP32) and done.precision == "fp16"
    answer = whole(fp16.engine, z)
    assert answer.precision == "fp32" and answer.fallback == (0, 1)  # the whole answer: all fp32
    told = answer.output.clone()
    told[1, :FIRST_FP32] = first_decode(fp16_alone, z[1:], "lossless", "uint8", upto_latent=2)[0]
    assert torch.equal(joined(chunks, 2), told)
    out, summary, _, grpc_summary = via_the_clients([*chunks, done])
    np.testing.assert_array_equal(out, told.numpy())
    assert summary.fallback_from_frame == grpc_summary.fallback_from_frame == [0, FIRST_FP32]


@pytest.mark.parametrize("output", ["uint8", "float"])
def test_an_item_that_overflows_in_its_first_latent_frame_streams_the_whole_answer(fp16, fp32, output):
    z = latents(overflow_from=(0,), frames=2, seed=2)
    *chunks, done = stream(fp16, z, "high", output)
    assert [c.frame for c in chunks] == [0, 1] and all(c.fallback for c in chunks)
    assert (done.fallback, done.fallback_from_frame, done.precision) == ((0,), (0,), "fp32")
    assert done.retried_from_frame is None  # nothing was sent before the fp32 frames
    answer = whole(fp16.engine, z, "high", output)
    assert answer.precision == "fp32" and torch.equal(answer.output, whole(fp32, z, "lossless", output).output)
    assert torch.equal(joined(chunks, 1), answer.output)
    out, summary, _, _ = via_the_clients([*chunks, done])
    np.testing.assert_array_equal(out, answer.output.numpy())
    assert (summary.precision, summary.fallback_from_frame) == ("fp32", [0])


def mp4_stream(service: DecodeService, z, quality="lossless") -> tuple[list[Mp4Fragment], DecodeResult]:
    async def events():
        s = await service.submit(lambda: DecodeRequest(z, quality, "mp4", stream=True), z.nbytes)
        return [e async for e in s.events()]

    *fragments, done = asyncio.run(events())
    return fragments, done


def test_a_streamed_mp4_that_falls_back_is_the_whole_mp4_of_the_frames_it_sent(fp16):
    z = latents(seed=3)
    fragments, done = mp4_stream(fp16, z)
    assert [(f.frame, f.frames) for f in fragments] == [(0, 1), (1, 4), (FIRST_FP32, 4)]
    assert (done.fallback, done.fallback_from_frame, done.precision) == ((0,), (FIRST_FP32,), "fp16")
    streamed = b"".join(f.data for f in fragments)
    # the frames stream of the same request: the same frames, so the whole mp4 answer of them
    *chunks, _ = stream(fp16, z)
    told = joined(chunks, 1)
    fragments = fp16.engine.video_fragments(prepared(fp16, z))
    encoded = encode_item(told[0].numpy(), "mp4", fp16.encoders.settings, fragments)
    assert streamed == encoded
    target = _Sink()
    summary = StreamSummary(write_chunks([streamed, video_stream_bytes(done, "mp4")], target))
    assert target.data == streamed
    assert (summary.precision, summary.fallback, summary.fallback_from_frame) == ("fp16", [0], [FIRST_FP32])


def test_a_streamed_mp4_whose_item_overflows_in_its_first_latent_frame_is_the_whole_mp4_answer(fp16):
    z = latents(overflow_from=(0,), frames=2, seed=4)
    fragments, done = mp4_stream(fp16, z)
    answer = asyncio.run(fp16.decode(DecodeRequest(z, "lossless", "mp4")))
    assert b"".join(f.data for f in fragments) == answer.output[0]
    assert (done.fallback, done.fallback_from_frame, done.precision) == ((0,), (0,), "fp32")
    assert (answer.fallback, answer.precision) == ((0,), "fp32")


def prepared(service: DecodeService, z):
    return service.engine.prepare(DecodeRequest(z, "lossless", "mp4"))


class _Sink:
    """A binary file object that keeps what was written."""

    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def flush(self) -> None:
        pass


# ---- the wire: small, optional, absent from whole answers --------------------------------------


def result(fallback=(), fallback_from_frame=None, precision="fp16") -> DecodeResult:
    from vae_service.engine.request.result import Timing

    return DecodeResult(
        None, "wan", precision, "lossless", "r", Timing(1.0, 2.0, 1), fallback=fallback,
        fallback_from_frame=fallback_from_frame,
    )  # fmt: skip


def test_the_done_message_carries_fallback_from_frame_only_beside_a_fallback():
    done = result((0, 2), (4, 0))
    read = message_of_proto(decode_pb2.FrameMessage.FromString(grpc_frame_message(done).SerializeToString()))
    assert read["done"]["fallback_from_frame"] == [4, 0] and read["done"]["fallback"] == [0, 2]
    reader = MessageReader()
    (http,) = reader.feed(http_frame_message(done))
    assert http == read
    plain = result()
    for event in (plain, result((1,), None)):  # no fallback, or a whole answer's result: no key
        assert "fallback_from_frame" not in message_of_proto(grpc_frame_message(event))["done"]
        (m,) = MessageReader().feed(http_frame_message(event))
        assert "fallback_from_frame" not in m["done"]
    assert "fallback_from_frame" not in response_of(result((1,), (3,))).summary()  # whole answers: as before


def test_a_summary_from_a_server_before_the_field_reads_as_before():
    old = {"precision": "fp32", "fallback": [0], "retried_from_frame": 5}
    assert StreamSummary(old).fallback_from_frame == [5]
    assert StreamSummary({"fallback": [0, 1]}).fallback_from_frame == [0, 0]
    assert StreamSummary({"fallback": []}).fallback_from_frame == []
