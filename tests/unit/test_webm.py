"""ClusteredWebm with real libvpx-vp9 on small frames: the EBML it writes, read back by a small parser here
(one cluster per fragment, each starting with a keyframe), and the file decoded by PyAV's own matroska
demuxer as a player would; the client's reader of a streamed webm answer."""

import io
import itertools
import json

import av
import numpy as np
import pytest

from vae_service.engine.media import webm as w
from vae_service.engine.media.webm import ClusteredWebm
from vae_service_client import VaeServiceError
from vae_service_client.mp4 import DONE_TAG, ERROR_TAG
from vae_service_client.webm import ElementReader, trailer

W, H, FPS = 64, 48, 16
SPLIT = [1, 4, 4]  # Wan's frames per latent frame


def gradient(t: int, width: int = W, height: int = H) -> np.ndarray:
    """A smooth image that moves with t."""
    y, x = np.mgrid[0:height, 0:width].astype(float)
    rgb = np.stack([40 + 3 * x + t, 30 + 3.5 * y, 200 - 1.5 * x - 1.5 * y + 2 * t], axis=-1)
    return rgb.round().astype(np.uint8)


FRAMES = np.stack([gradient(t) for t in range(9)])


def write(frames: np.ndarray, split: list[int], **settings) -> bytes:
    writer = ClusteredWebm(frames.shape[2], frames.shape[1], FPS, **settings)
    starts = np.cumsum([0, *split])
    data = writer.init_segment() + b"".join(writer.fragment(frames[a:b]) for a, b in itertools.pairwise(starts))
    writer.close()
    return data


# ---- a small EBML reader, independent of the writer's helpers


def vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int]:
    length = 9 - data[at].bit_length()
    value = int.from_bytes(data[at : at + length], "big")
    return (value if keep_marker else value & ((1 << (7 * length)) - 1)), length


def elements(data: bytes) -> list[tuple[int, int | None, bytes]]:
    """(id, size or None when unknown, payload) of the elements in `data`; an element of unknown size holds
    the rest of the data, parsed as its children."""
    found, at = [], 0
    while at < len(data):
        kind, id_length = vint(data, at, keep_marker=True)
        size, size_length = vint(data, at + id_length, keep_marker=False)
        start = at + id_length + size_length
        if size == (1 << (7 * size_length)) - 1:
            found.append((kind, None, data[start:]))
            return found
        assert start + size <= len(data), f"element {kind:#x} of {size} bytes at {at} overruns {len(data)}"
        found.append((kind, size, data[start : start + size]))
        at = start + size
    return found


def uint_of(payload: bytes, kind: int) -> int:
    [value] = [p for k, _, p in elements(payload) if k == kind]
    return int.from_bytes(value, "big")


def clusters(data: bytes) -> list[tuple[int, list[tuple[int, bool]]]]:
    """Each cluster's (timecode, [(block time relative to it, keyframe)]); checks the layout on the way."""
    top = elements(data)
    assert [(k, s is None) for k, s, _ in top] == [(w.EBML, False), (w.SEGMENT, True)]
    segment = elements(top[1][2])
    assert [k for k, _, _ in segment[:2]] == [w.INFO, w.TRACKS]
    out = []
    for kind, _, payload in segment[2:]:
        assert kind == w.CLUSTER
        children = elements(payload)
        assert children[0][0] == w.TIMECODE and {k for k, _, _ in children[1:]} == {w.SIMPLE_BLOCK}
        blocks = []
        for _, _, block in children[1:]:
            assert block[0] == 0x81  # track 1
            relative = int.from_bytes(block[1:3], "big", signed=True)
            blocks.append((relative, bool(block[3] & 0x80)))
            assert block[3] & 0x7F == 0  # no lacing, nothing invisible
        out.append((int.from_bytes(children[0][2], "big"), blocks))
    return out


def decode(data: bytes) -> list[av.VideoFrame]:
    with av.open(io.BytesIO(data)) as container:
        assert container.format.name == "matroska,webm"
        return list(container.decode(video=0))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return 10 * np.log10(255**2 / np.mean((a.astype(float) - b) ** 2))


@pytest.mark.parametrize("split", [SPLIT, [9]])
def test_one_cluster_per_fragment_each_starting_with_a_keyframe_and_pyav_plays_it(split):
    data = write(FRAMES, split)
    found = clusters(data)
    assert [len(blocks) for _, blocks in found] == split
    starts = np.cumsum([0, *split[:-1]]).tolist()
    for (timecode, blocks), start in zip(found, starts, strict=True):
        assert timecode == int(start * 1000 / FPS + 0.5)  # half up: 62.5 ms is 63
        assert [key for _, key in blocks] == [True] + [False] * (len(blocks) - 1)
        assert [timecode + rel for rel, _ in blocks] == [w.frame_ms(start + i, FPS) for i in range(len(blocks))]
    frames = decode(data)
    assert len(frames) == len(FRAMES) and {(f.width, f.height) for f in frames} == {(W, H)}
    assert [f.key_frame for f in frames] == [i in starts for i in range(len(FRAMES))]
    assert [f.time for f in frames] == pytest.approx([i / FPS for i in range(len(FRAMES))], abs=1e-3)
    # the bitstream and the track both say BT.709 limited range, and PyAV's conversion back honours it:
    # crf 32 on these gradients measured 36.6-40.6 dB
    for frame, rgb in zip(frames, FRAMES, strict=True):
        assert (frame.colorspace, frame.color_range) == (1, 1)
        assert psnr(frame.to_ndarray(format="rgb24"), rgb) > 34


def test_init_segment_says_webm_vp9_with_its_size_rate_and_colour():
    init = ClusteredWebm(W, H, FPS).init_segment()
    header, segment = elements(init)
    assert [p for k, _, p in elements(header[2]) if k == w.DOC_TYPE] == [b"webm"]
    info, tracks = elements(segment[2])
    assert uint_of(info[2], w.TIMECODE_SCALE) == 1_000_000
    [(_, _, entry)] = elements(tracks[2])
    assert [p for k, _, p in elements(entry) if k == w.CODEC_ID] == [b"V_VP9"]
    assert uint_of(entry, w.DEFAULT_DURATION) == 62_500_000  # ns, 1/16 s
    [video] = [p for k, _, p in elements(entry) if k == w.VIDEO]
    assert (uint_of(video, w.PIXEL_WIDTH), uint_of(video, w.PIXEL_HEIGHT)) == (W, H)
    [colour] = [p for k, _, p in elements(video) if k == w.COLOUR]
    assert [uint_of(colour, k) for k in (w.PRIMARIES, w.TRANSFER, w.MATRIX_COEFFICIENTS, w.RANGE)] == [1, 1, 1, 1]


def test_same_frames_and_split_give_the_same_bytes_and_the_settings_reach_libvpx():
    first = write(FRAMES, SPLIT)
    assert write(FRAMES, SPLIT) == first
    assert len(write(FRAMES, SPLIT, crf=4)) > 2 * len(write(FRAMES, SPLIT, crf=60))
    noise = np.random.default_rng(0).integers(0, 256, (8, H, W, 3), dtype=np.uint8)
    low, high = (len(write(noise, [4, 4], crf=None, bitrate=rate)) for rate in (50_000, 2_000_000))
    assert high > 1.5 * low  # measured 1.9x (8 frames of noise at 64x48)
    # an odd size (VP9 takes any) and a fragment past a block's int16 of milliseconds: another cluster
    odd = np.stack([gradient(t, 33, 17) for t in range(2)])
    assert len(decode(write(odd, [2]))) == 2
    long = np.repeat(odd[:1], 32768 * FPS // 1000 + 2, axis=0)
    assert [len(blocks) for _, blocks in clusters(write(long, [len(long)], speed=8))] == [len(long) - 1, 1]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"crf": 64}, "crf must be within 0..63"),
        ({"crf": 20, "bitrate": 10_000}, "exactly one of crf and bitrate"),
        ({"speed": 9}, "speed"),
        ({"threads": 0}, "threads"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ClusteredWebm(W, H, FPS, **settings)


def test_the_clients_reader_passes_elements_on_as_they_complete_and_keeps_the_summary_apart():
    data = write(FRAMES, SPLIT)
    body = data + trailer(DONE_TAG, {"request_id": "r"})
    reader, media = ElementReader(), b""
    for at in range(0, len(body), 7):  # cut anywhere: elements straddle pieces
        media += reader.feed(body[at : at + 7])
    assert media == data and reader.close() == {"request_id": "r"}
    # players skip the closing Void: the whole body still decodes
    assert len(decode(body)) == len(FRAMES)
    failed = ElementReader()
    error = {"type": "internal", "field": "output", "message": "encoding the decoded pixels as webm failed"}
    assert failed.feed(data + trailer(ERROR_TAG, error)) == data
    with pytest.raises(VaeServiceError, match="as webm failed"):
        failed.close()
    short = ElementReader()
    last_cluster = len(elements(elements(data)[1][2])[-1][2])
    assert len(short.feed(data[:-3])) < len(data) - last_cluster  # a cluster leaves whole or not at all
    with pytest.raises(VaeServiceError, match="ended inside an element"):
        short.close()
    assert json.loads(trailer(DONE_TAG, {"a": 1})[2 + len(DONE_TAG) :]) == {"a": 1}
