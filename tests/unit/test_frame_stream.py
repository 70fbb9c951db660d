"""Streamed requests in the replica core (no Ray): frames come out as each latent frame is decoded,
bit-identical to the whole answer; errors before the first frame surface as ordinary errors;
leaving a stream stops its decode; a retried decode never repeats a frame; the wire messages
round-trip through the client's reader."""

import asyncio
import threading

import msgpack
import numpy as np
import pytest
import torch

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest, InvalidInput
from vae_service.engine.result import DecodeResult
from vae_service.engine.video import FrameChunk
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.frame_stream import FrameStream
from vae_service.serving.http_routes import decode_events
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
        await service.submit(lambda: DecodeRequest(latents(), output="mp4", stream=True), 0)
    assert err.value.field == "stream"
    with pytest.raises(InvalidInput, match="streaming call") as err:  # the whole-answer call refuses streams
        await service.decode(DecodeRequest(latents(), stream=True))


async def test_leaving_a_stream_stops_its_decode_at_the_next_latent_frame(service):
    frames, calls, second = 40, [], threading.Event()

    def count(module, args):
        calls.append(1)
        if len(calls) == 2:
            second.set()

    service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(count)
    z = torch.zeros(1, 4, frames, 4, 4)
    stream = await service.submit(lambda: DecodeRequest(z, stream=True), z.nbytes)
    events = stream.events()
    first = await anext(events)
    assert isinstance(first, FrameChunk) and first.frame == 0
    await asyncio.to_thread(second.wait, 30)
    await events.aclose()  # the client went away
    while service.batcher.running:
        await asyncio.sleep(0.01)
    assert 2 <= len(calls) < frames // 2
    ok = await service.decode(DecodeRequest(torch.zeros(1, 4, 1, 2, 2)))  # the device is free again
    assert ok.output.shape == (1, 1, 16, 16, 3)


async def test_a_retried_decode_never_repeats_a_frame():
    stream = FrameStream()
    frames = torch.arange(9 * 2 * 2 * 3, dtype=torch.uint8).reshape(1, 9, 2, 2, 3)
    chunks = [FrameChunk(0, 0, frames[:, :1]), FrameChunk(0, 1, frames[:, 1:5])]
    retry = [FrameChunk(0, 0, frames[:, :1]), FrameChunk(0, 1, frames[:, 1:5]), FrameChunk(0, 5, frames[:, 5:9])]
    shifted = FrameChunk(0, 3, frames[:, 3:9])  # a chunk reaching back into sent frames
    passed = [stream._fresh(c) for c in [*chunks, *retry, shifted]]
    kept = [c for c in passed if c is not None]
    assert [(c.frame, c.frames) for c in kept] == [(0, 1), (1, 4), (5, 4)]
    assert torch.equal(torch.cat([c.pixels for c in kept], 1), frames)
    assert stream._fresh(FrameChunk(0, 7, frames[:, 7:9])) is None


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
    from vae_service.engine import video

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
    with pytest.raises(ValueError, match="ended inside a message"):
        reader.close()
