"""Streamed requests in the replica core (no Ray): frames come out as each latent frame is decoded,
bit-identical to the whole answer; errors before the first frame surface as ordinary errors;
leaving a stream stops its decode; the wire messages round-trip through the client's reader (a
retried stream: tests/unit/test_out_of_memory_retry.py)."""

import asyncio

import msgpack
import numpy as np
import pytest
import torch

from tests.unit.test_decode_service import hold_in_frame
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest, InvalidInput
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.request.errors import DecodeAbandoned
from vae_service.engine.request.result import DecodeResult
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.outputs.frame_stream import FrameStream
from vae_service.serving.wire.http_routes import decode_events
from vae_service_client.errors import Unavailable
from vae_service_client.frames import STREAM_MEDIA_TYPE, MessageReader, assemble
from vae_service_client.frames import FrameStream as ClientStream
from vae_service_client.messages import MSGPACK, pack, request_map


@pytest.fixture
def service(wan_dir):
    return DecodeService(ServiceConfig(model=str(wan_dir), model_name="wan", device="cpu", cpu_threads=1))


def latents(frames=3, batch=2, seed=0):
    return torch.randn(batch, 4, frames, 3, 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("quality", ["lossless", "high"])
async def test_streamed_frames_join_into_the_whole_answer(service, quality):
    z = latents()
    whole = await service.decode(DecodeRequest(z, quality=quality))
    stream = await service.submit(lambda: DecodeRequest(z, quality=quality, stream=True), z.nbytes)
    assert isinstance(stream, FrameStream)
    events = [e async for e in stream.events()]
    *chunks, result = events
    assert all(isinstance(c, FrameChunk) for c in chunks) and isinstance(result, DecodeResult)
    assert result.output is None and result.quality == quality and result.timing.decode_ms > 0
    joined = {}
    for c in chunks:
        joined.setdefault(c.item, []).append(c.pixels)
    out = torch.cat([torch.cat(joined[i], 1) for i in sorted(joined)])
    assert torch.equal(out, whole.output)


async def test_errors_before_the_first_frame_are_raised_by_submit(service):
    with pytest.raises(InvalidInput) as err:
        await service.submit(lambda: DecodeRequest(latents(), output="png", stream=True), 0)
    assert err.value.field == "stream"
    with pytest.raises(InvalidInput, match="streaming call") as err:  # the whole-answer call refuses streams
        await service.decode(DecodeRequest(latents(), stream=True))


async def test_leaving_a_stream_stops_its_decode_at_the_next_latent_frame(service):
    """The decode is held inside its second latent frame (the first one's frames already went out)
    until the service has seen the client leave; then it finishes that frame and starts no other."""
    frames, held = 40, 2
    calls, reached, watch = hold_in_frame(service, held)
    z = torch.zeros(1, 4, frames, 4, 4)
    stream = await service.submit(lambda: DecodeRequest(z, stream=True), z.nbytes)
    events = stream.events()
    first = await anext(events)
    assert isinstance(first, FrameChunk) and first.frame == 0
    assert await asyncio.to_thread(reached.wait, 30)
    await events.aclose()  # the client went away
    assert await asyncio.to_thread(watch.finished.wait, 30)
    assert watch.saw_abandoned == [True]
    assert len(calls) == held  # the held frame finished; no further frame started
    (outcome,) = watch.outcome  # the batch's results: the request's is its abandonment
    assert [type(o) for o in outcome] == [DecodeAbandoned]
    ok = await service.decode(DecodeRequest(torch.zeros(1, 4, 1, 2, 2)))  # the device is free again
    assert ok.output.shape == (1, 1, 16, 16, 3)


async def test_http_stream_messages_read_back_with_the_client(service):
    z = latents(frames=2, batch=1)
    body = pack(request_map(z, "high", stream=True, request_id="s1"))
    events = decode_events(service, body, MSGPACK)
    head = await anext(events)
    assert head.status == 200 and head.media_type == STREAM_MEDIA_TYPE
    reader, messages = MessageReader(), []
    async for data in events:
        for i in range(0, len(data), 7):  # any split of the bytes reads the same
            messages += reader.feed(data[i : i + 7])
    reader.close()
    stream = ClientStream(messages)
    chunks = list(stream)
    assert stream.summary.request_id == "s1" and stream.summary.quality == "high" and not stream.summary.tiled
    whole = await service.decode(DecodeRequest(z, quality="high"))
    np.testing.assert_array_equal(assemble(chunks), whole.output.numpy())
    assert [c.frame for c in chunks] == [0, 1]


async def test_an_error_after_frames_ends_the_stream_with_an_error_message(service, monkeypatch):
    """A NaN in the second latent frame's output: the first frames went out, then the error."""
    from vae_service.engine.execution import video

    real_add = video._Answer.add

    def poison_second_chunk(self, item, frame, decoded):
        if frame > 0:
            decoded = decoded.clone().fill_(float("nan"))
        return real_add(self, item, frame, decoded)

    monkeypatch.setattr(video._Answer, "add", poison_second_chunk)
    body = pack(request_map(latents(frames=2, batch=1), stream=True))
    events = decode_events(service, body, MSGPACK)
    assert (await anext(events)).media_type == STREAM_MEDIA_TYPE
    messages = MessageReader().feed(b"".join([d async for d in events]))
    assert "pixels" in messages[0] and messages[-1]["error"]["type"] == "decode_failed"
    assert messages[-1]["error"]["field"] == "latents"
    with pytest.raises(Exception, match="NaN") as err:
        list(ClientStream(messages))
    assert err.value.status == 422


def test_reader_refuses_a_broken_stream():
    reader = MessageReader()
    with pytest.raises(ValueError, match="not a vae-service frame stream"):
        reader.feed(b"\xff\xff\xff\xff" + msgpack.packb({}))
    reader = MessageReader()
    reader.feed(b"\x00\x00\x00\x10abc")
    with pytest.raises(Unavailable, match="ended inside a message"):  # cut off: typed, like any cut stream
        reader.close()


def _px(frames: int) -> torch.Tensor:
    return torch.zeros(1, frames, 2, 2, 3, dtype=torch.uint8)


async def _replayed(chunks: list[FrameChunk], result: DecodeResult) -> list:
    """A FrameStream fed `chunks` from a device thread, then answered `result`: what it passes on."""
    from vae_service.config import Limits
    from vae_service.engine.request.context import RequestContext

    stream = FrameStream(2, RequestContext.admit(60, Limits()))

    def device() -> DecodeResult:
        for chunk in chunks:
            stream.sink(chunk)
        return result

    await stream.start(asyncio.ensure_future(asyncio.to_thread(device)))
    return [e async for e in stream.events()]


def _result(precision: str, fallback: tuple[int, ...]) -> DecodeResult:
    from vae_service.engine.request.result import Timing

    return DecodeResult(None, "wan", precision, "lossless", None, Timing(0.0, 1.0, 2), fallback=fallback)


async def test_fp32_fallback_frames_pass_on_from_the_first_frame_not_sent_and_the_result_says_so():
    """Item 1 sent frame 0 in fp16, then fell back: an fp32 chunk from frame 0 (a retried
    answer's, which hands its item over again) passes on from frame 1 only; the result names the
    frame each fallen-back item's fp32 frames begin at, and fp16 where frames went out in fp16."""
    chunks = [
        FrameChunk(0, 0, _px(1), "fp16"),
        FrameChunk(1, 0, _px(1), "fp16"),
        FrameChunk(0, 1, _px(4), "fp16"),
        FrameChunk(1, 0, _px(5), "fp32", fallback=True),
        FrameChunk(0, 5, _px(4), "fp32", fallback=True),
    ]
    *out, done = await _replayed(chunks, _result("fp32", (0, 1)))  # the engine: every item fell back
    assert [(c.item, c.frame, c.frames, c.fallback) for c in out] == [
        (0, 0, 1, False),
        (1, 0, 1, False),
        (0, 1, 4, False),
        (1, 1, 4, True),
        (0, 5, 4, True),
    ]
    assert done.fallback_from_frame == (5, 1) and done.precision == "fp16" and done.retried_from_frame == 1

    all_fp32 = [FrameChunk(0, 0, _px(5), "fp32", fallback=True), FrameChunk(1, 0, _px(5), "fp32", fallback=True)]
    *_, done = await _replayed(all_fp32, _result("fp32", (0, 1)))
    assert (done.fallback_from_frame, done.precision, done.retried_from_frame) == ((0, 0), "fp32", None)
    *_, done = await _replayed([FrameChunk(0, 0, _px(5)), FrameChunk(1, 0, _px(5))], _result("fp16", ()))
    assert (done.fallback_from_frame, done.precision, done.retried_from_frame) == (None, "fp16", None)
