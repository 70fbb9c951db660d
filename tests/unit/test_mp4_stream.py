"""Streamed mp4 answers in the replica core (no Ray; the wire through Serve: tests/integration/
test_mp4_streaming.py, a browser: test_browser_playback.py): the stream is the whole `mp4` answer
byte for byte, one fragment per latent frame; its first fragment leaves before the second latent
frame is decoded; a slow encoder holds the decode back instead of buffering the clip, on the
encoder pool's threads; a failed encode ends the stream with an error box; the encoder settings
reach the encoder; the client writes each box as it arrives."""

import asyncio
import io
import threading

import av
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest, InvalidInput
from vae_service.engine.request.result import DecodeResult
from vae_service.protocol.responses import video_stream_bytes
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.outputs import video_stream
from vae_service.serving.outputs.frame_stream import CHUNKS_AHEAD
from vae_service.serving.wire.http_routes import decode_events
from vae_service_client import VaeServiceError
from vae_service_client.messages import MSGPACK, pack, request_map
from vae_service_client.mp4 import BoxReader, Mp4Fragment, write_chunks

WAN_FRAMES = [1, 4, 4, 4, 4, 4, 4, 4, 4, 4]  # frames per latent frame (Wan: 1, then 4 each)


def service_for(wan_dir, **config) -> DecodeService:
    return DecodeService(ServiceConfig(model=str(wan_dir), device="cpu", cpu_threads=1, **config))


@pytest.fixture(scope="module")
def service(wan_dir):
    return service_for(wan_dir)


def latents(frames=3, h=3, w=5, seed=0):
    return torch.randn(1, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


async def stream_events(service, z, quality="lossless"):
    stream = await service.submit(lambda: DecodeRequest(z, quality, "mp4", stream=True), z.nbytes)
    return stream, [e async for e in stream.events()]


def boxes(data: bytes) -> list[bytes]:
    """The top-level box types of `data`, which must hold whole boxes only."""
    kinds, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        kinds.append(data[at + 4 : at + 8])
        at += size
    assert at == len(data), f"a box runs {at - len(data)} bytes past the data"
    return kinds


def decoded_frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("shape", [(3, 3, 5), (1, 2, 2), (4, 5, 3)])
async def test_the_stream_is_the_whole_answer_byte_for_byte_one_fragment_per_latent_frame(service, quality, shape):
    z = latents(*shape)
    whole = await service.decode(DecodeRequest(z, quality, "mp4"))
    stream, events = await stream_events(service, z, quality)
    fragments, result = events[:-1], events[-1]
    assert all(isinstance(f, Mp4Fragment) for f in fragments) and isinstance(result, DecodeResult)
    streamed = b"".join(f.data for f in fragments)
    assert streamed == whole.output[0]
    counts = WAN_FRAMES[: shape[0]]
    assert [f.frames for f in fragments] == counts
    assert [f.frame for f in fragments] == list(np.cumsum([0, *counts[:-1]]))
    assert boxes(streamed) == [b"ftyp", b"moov"] + [b"moof", b"mdat"] * len(counts)
    assert stream.codecs.startswith("avc1.")
    frames = decoded_frames(streamed)
    assert len(frames) == sum(counts) and frames[0].shape == (shape[1] * 8, shape[2] * 8, 3)
    for a, b in zip(frames, decoded_frames(whole.output[0]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert result.output is None and result.timing.encode_ms > 0


@pytest.mark.parametrize("model, per_latent_frame", [("tiny-ltx-video", 8), ("tiny-hunyuan-video", 4)])
async def test_a_decoder_that_hands_the_whole_clip_over_still_streams_a_fragment_per_latent_frame(
    model, per_latent_frame
):
    """Classes decoded through their own `decode` hand the clip over at once: the stream still cuts
    it into one fragment per latent frame (their temporal law), the whole answer's bytes."""
    service = DecodeService(ServiceConfig(model=model, cpu_threads=1, serving={"fit_prices_at_start": False}))
    z = torch.randn(1, service.engine.spec.latent_channels, 3, 4, 6, generator=torch.Generator().manual_seed(3))
    whole = await service.decode(DecodeRequest(z, output="mp4"))
    _, events = await stream_events(service, z)
    assert [(f.frame, f.frames) for f in events[:-1]] == [
        (0, 1),
        (1, per_latent_frame),
        (1 + per_latent_frame, per_latent_frame),
    ]
    assert b"".join(f.data for f in events[:-1]) == whole.output[0]


@pytest.mark.parametrize("output", ["mp4", "webm"])
async def test_the_first_fragment_leaves_before_the_second_latent_frame_is_decoded(wan_dir, output):
    """The decoder's mid-block attention runs once per latent frame: the second run waits until
    the first fragment reached the caller. Were the fragment made only after the second latent
    frame (a muxer that closes a fragment when the next frame arrives), it would wait in vain.
    The same for webm, whose stream is its whole answer byte for byte too (a Cluster per fragment)."""
    service = service_for(wan_dir)
    first_out, waited = threading.Event(), []
    runs = []

    def second_waits(module, args):
        runs.append(1)
        if len(runs) == 2:
            waited.append(first_out.wait(30))

    service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(second_waits)
    z = latents(3)
    stream = await service.submit(lambda: DecodeRequest(z, "lossless", output, stream=True), z.nbytes)
    events = stream.events()
    first = await anext(events)
    first_out.set()
    rest = [e async for e in events]
    assert isinstance(first, Mp4Fragment) and first.frames == 1
    assert waited == [True] and len(rest) == 3  # two more fragments and the result
    if output == "mp4":
        assert boxes(first.data)[:2] == [b"ftyp", b"moov"]
        return
    assert first.data.startswith(b"\x1a\x45\xdf\xa3") and stream.media_type == 'video/webm; codecs="vp9"'
    whole = await service.decode(DecodeRequest(z, "lossless", "webm"))
    assert b"".join(e.data for e in [first, *rest[:-1]]) == whole.output[0]


async def test_a_slow_encoder_holds_the_decode_back_on_the_pools_threads(wan_dir, monkeypatch):
    service = service_for(wan_dir)
    release, threads, runs = threading.Event(), [], []
    make_writer = video_stream.video_writer

    class SlowWriter:
        def __init__(self, *args):
            self.writer = make_writer(*args)
            self.codecs = self.writer.codecs

        def init_segment(self):
            return self.writer.init_segment()

        def fragment(self, frames):
            threads.append(threading.current_thread().name)
            release.wait(30)
            return self.writer.fragment(frames)

        def close(self):
            self.writer.close()

    monkeypatch.setattr(video_stream, "video_writer", SlowWriter)
    service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(lambda m, a: runs.append(1))
    z = latents(len(WAN_FRAMES), 2, 2)
    stream = await service.submit(lambda: DecodeRequest(z, "lossless", "mp4", stream=True), z.nbytes)
    events = stream.events()
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(2.0)  # the decode runs on while the first fragment encodes, up to its bound
    decoded_while_held = len(runs)
    release.set()
    fragments = [await first, *[e async for e in events][:-1]]
    assert decoded_while_held <= CHUNKS_AHEAD + 2 < len(WAN_FRAMES)
    assert len(fragments) == len(WAN_FRAMES) and len(runs) == len(WAN_FRAMES)
    assert threads and all(name.startswith("vae-encode") for name in threads)


async def test_an_encode_that_fails_mid_stream_ends_with_an_error_box(wan_dir, monkeypatch):
    service = service_for(wan_dir)
    make_writer, calls = video_stream.video_writer, []

    def failing_writer(*args):
        writer = make_writer(*args)
        fragment = writer.fragment

        def second_fails(frames):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("x264 gave up")
            return fragment(frames)

        writer.fragment = second_fails
        return writer

    monkeypatch.setattr(video_stream, "video_writer", failing_writer)
    events = decode_events(service, pack(request_map(latents(3), "lossless", "mp4", stream=True)), MSGPACK)
    opened = await anext(events)
    assert opened.status == 200 and opened.media_type.startswith('video/mp4; codecs="avc1.')
    body = b"".join([data async for data in events])
    reader = BoxReader()
    media = reader.feed(body)  # what went out before the failure is passed on, then the error raised
    with pytest.raises(VaeServiceError, match="encoding the decoded pixels as mp4 failed") as err:
        reader.close()
    assert err.value.field == "output"
    assert boxes(body) == [b"ftyp", b"moov", b"moof", b"mdat", b"free"]
    assert boxes(media) == [b"ftyp", b"moov", b"moof", b"mdat"] and len(decoded_frames(media)) == 1


def test_a_streamed_mp4_is_one_video_of_a_video_model(service, kl_dir):
    with pytest.raises(InvalidInput, match="one video") as err:
        service.engine.prepare(DecodeRequest(torch.randn(2, 4, 3, 2, 2), output="mp4", stream=True))
    assert err.value.field == "output"
    image = service_for(kl_dir).engine
    with pytest.raises(InvalidInput, match="video models") as err:
        image.prepare(DecodeRequest(torch.randn(1, 4, 2, 2), output="mp4", stream=True))
    assert err.value.field == "output"
    whole = service.engine.prepare(DecodeRequest(torch.randn(2, 4, 3, 2, 2), output="mp4"))
    assert whole.items == 2  # whole answers: one mp4 per item, as before


async def test_the_encoder_settings_reach_the_encoder(wan_dir):
    z = latents(2, 4, 6, seed=1)

    async def size(**encoding) -> int:
        service = service_for(wan_dir, encoding=encoding)
        _, events = await stream_events(service, z)
        return sum(len(e.data) for e in events[:-1])

    fine, coarse = await size(mp4_crf=5), await size(mp4_crf=45)
    low_rate, high_rate = await size(mp4_bitrate=10_000), await size(mp4_bitrate=2_000_000)
    assert fine > 2 * coarse and high_rate > 1.5 * low_rate
    with pytest.raises(ValidationError, match="mp4_preset"):
        ServiceConfig(encoding={"mp4_preset": "ludicrous"})
    with pytest.raises(ValidationError, match="mp4_crf"):
        ServiceConfig(encoding={"mp4_crf": 52})


async def test_the_client_writes_each_box_as_soon_as_it_is_whole(service):
    z = latents(3, seed=2)
    _, events = await stream_events(service, z)
    media = b"".join(e.data for e in events[:-1])
    body = media + video_stream_bytes(events[-1], "mp4")
    pieces = [body[i : i + 777] for i in range(0, len(body), 777)]  # cut anywhere, boxes straddle pieces
    written = []

    class Watched(io.BytesIO):
        def flush(self):
            written.append(self.getvalue())

    out = Watched()
    summary = write_chunks(iter(pieces), out)
    assert out.getvalue() == media and summary["model"] == events[-1].model
    for w in written:
        boxes(w)  # every flush holds whole boxes only
    assert len(written) >= 4  # written as they came, not at the end
    with pytest.raises(VaeServiceError, match="ended before its summary"):
        write_chunks(iter([media]), io.BytesIO())
