"""FragmentedMp4 with real libx264 on small frames: the boxes it writes, read back by a small parser here, and
the stream decoded by PyAV's own mov demuxer as a player would."""

import io
import itertools
import re
import struct

import av
import numpy as np
import pytest

from vae_service.engine.media.fmp4 import FragmentedMp4

W, H, FPS = 64, 48, 16
CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"mvex", b"moof", b"traf", b"dinf"}
SYNC, NON_SYNC = 0x02000000, 0x01010000


def boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """Top-level (type, payload) pairs; fails on a size that overruns the data."""
    found, at = [], 0
    while at < len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        assert size >= 8 and at + size <= len(data), f"{kind} of {size} bytes at {at} overruns {len(data)}"
        found.append((kind, data[at + 8 : at + size]))
        at += size
    return found


def child(data: bytes, *path: bytes) -> bytes:
    """The payload at path, descending through container boxes (stsd and avc1 have fields before children)."""
    for kind in path:
        matches = [payload for name, payload in boxes(data) if name == kind]
        assert len(matches) == 1, f"{len(matches)} {kind} boxes"
        data = matches[0]
        if kind == b"stsd":
            data = data[8:]
        elif kind == b"avc1":
            data = data[78:]
    return data


def gradient(t: int) -> np.ndarray:
    """A smooth image that moves with t: 4:2:0 chroma loses little of it, so decoding errors stay small."""
    y, x = np.mgrid[0:H, 0:W].astype(float)
    rgb = np.stack([40 + 3 * x + t, 30 + 3.5 * y, 200 - 1.5 * x - 1.5 * y + 2 * t], axis=-1)
    return rgb.round().astype(np.uint8)


FRAMES = np.stack([gradient(t) for t in range(9)])


def write(frames: np.ndarray, split: list[int], **settings) -> tuple[bytes, list[bytes]]:
    writer = FragmentedMp4(W, H, FPS, **settings)
    starts = np.cumsum([0, *split])
    fragments = [writer.fragment(frames[a:b]) for a, b in itertools.pairwise(starts)]
    writer.close()
    return writer.init_segment(), fragments


def trun_samples(fragment: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    trun = child(fragment, b"moof", b"traf", b"trun")
    assert struct.unpack_from(">I", trun)[0] == 0x000701  # version 0; data offset, duration, size, flags
    count, offset = struct.unpack_from(">Ii", trun, 4)
    return offset, [struct.unpack_from(">III", trun, 12 + 12 * i) for i in range(count)]


def decode(data: bytes) -> tuple[list[av.VideoFrame], float]:
    with av.open(io.BytesIO(data)) as container:
        return list(container.decode(video=0)), container.duration / av.time_base


def colour_round_trip(rgb: np.ndarray) -> np.ndarray:
    """What an exact (lossless) codec gives back: RGB -> BT.709 limited-range yuv420p -> RGB."""
    yuv = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
        format="yuv420p", dst_colorspace="itu709", dst_color_range=1, threads=1
    )
    return yuv.to_ndarray(format="rgb24", src_colorspace="itu709", src_color_range=1)


def test_fragments_are_moof_then_mdat_with_running_sequence_and_decode_times():
    init, fragments = write(FRAMES, [1, 4, 4])
    assert [kind for kind, _ in boxes(init)] == [b"ftyp", b"moov"]
    for number, (fragment, before, count) in enumerate(zip(fragments, [0, 1, 5], [1, 4, 4], strict=True), 1):
        (moof_kind, moof), (mdat_kind, mdat) = boxes(fragment)  # exactly two boxes
        assert (moof_kind, mdat_kind) == (b"moof", b"mdat")
        assert struct.unpack(">II", child(fragment, b"moof", b"mfhd")) == (0, number)
        assert struct.unpack(">II", child(fragment, b"moof", b"traf", b"tfhd")) == (0x020000, 1)
        assert struct.unpack(">IQ", child(fragment, b"moof", b"traf", b"tfdt")) == (1 << 24, before)

        offset, samples = trun_samples(fragment)
        assert len(samples) == count
        assert [flags for _, _, flags in samples] == [SYNC] + [NON_SYNC] * (count - 1)
        assert all(duration == 1 for duration, _, _ in samples)
        # default-base-is-moof: the offset counts from the moof's first byte to the mdat payload
        assert offset == len(moof) + 8 + 8
        assert sum(size for _, size, _ in samples) == len(mdat)

        at = 0
        for index, (_, size, _) in enumerate(samples):
            sample, at = mdat[at : at + size], at + size
            nal_types, pos = [], 0
            while pos < len(sample):  # 4-byte length prefixes tile the sample exactly
                (length,) = struct.unpack_from(">I", sample, pos)
                nal_types.append(sample[pos + 4] & 0x1F)
                pos += 4 + length
            assert pos == len(sample)
            assert (5 in nal_types) == (index == 0)  # IDR first, then slices that are not
            assert not {7, 8, 9} & set(nal_types)  # parameter sets live in avcC


def test_init_segment_describes_one_h264_track_and_stays_the_same():
    writer = FragmentedMp4(W, H, FPS)
    init = writer.init_segment()
    writer.fragment(FRAMES[:2])
    assert writer.init_segment() == init

    ftyp = child(init, b"ftyp")
    assert ftyp[:4] == b"isom"
    assert {ftyp[i : i + 4] for i in range(8, len(ftyp), 4)} == {b"isom", b"iso6", b"avc1", b"mp41"}
    tkhd = child(init, b"moov", b"trak", b"tkhd")
    assert struct.unpack_from(">I", tkhd)[0] == 3 and struct.unpack_from(">I", tkhd, 12)[0] == 1
    assert struct.unpack_from(">II", tkhd, len(tkhd) - 8) == (W << 16, H << 16)
    assert struct.unpack_from(">I", child(init, b"moov", b"trak", b"mdia", b"mdhd"), 12)[0] == FPS
    assert child(init, b"moov", b"trak", b"mdia", b"hdlr")[8:12] == b"vide"
    stbl = child(init, b"moov", b"trak", b"mdia", b"minf", b"stbl")
    assert [kind for kind, _ in boxes(stbl)] == [b"stsd", b"stts", b"stsc", b"stsz", b"stco"]
    assert [kind for kind, _ in boxes(child(stbl, b"stsd"))] == [b"avc1"]
    avc1 = child(stbl, b"stsd")[8:]
    assert struct.unpack_from(">HH", avc1, 24) == (W, H)
    assert struct.unpack_from(">Hh", avc1, 74) == (0x18, -1)
    trex = child(init, b"moov", b"mvex", b"trex")
    assert struct.unpack_from(">II", trex, 4) == (1, 1)  # track 1, sample description 1


def test_codecs_string_agrees_with_the_sps_in_avcc():
    writer = FragmentedMp4(W, H, FPS)
    avcc = child(writer.init_segment(), b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsd", b"avc1", b"avcC")
    assert re.fullmatch(r"avc1\.[0-9a-f]{6}", writer.codecs)
    (sps_length,) = struct.unpack_from(">H", avcc, 6)
    sps = avcc[8 : 8 + sps_length]
    assert avcc[0] == 1 and avcc[4] == 0xFF and avcc[5] == 0xE1  # version 1, 4-byte lengths, one SPS
    assert sps[0] & 0x1F == 7 and avcc[1:4] == sps[1:4]
    assert writer.codecs == "avc1." + sps[1:4].hex()
    pps_count, pps_length = struct.unpack_from(">BH", avcc, 8 + sps_length)
    assert pps_count == 1 and avcc[11 + sps_length] & 0x1F == 8
    # High profile (100) carries chroma format 1 (4:2:0) and 8-bit depths after the PPS
    assert sps[1] == 100
    assert avcc[11 + sps_length + pps_length :] == bytes([0xFD, 0xF8, 0xF8, 0])


@pytest.mark.parametrize("split", [[1, 4, 4], [9], [1] * 9])
def test_pyav_plays_the_stream_with_keyframes_at_fragment_starts(split):
    init, fragments = write(FRAMES, split, crf=0)
    frames, duration = decode(init + b"".join(fragments))
    assert len(frames) == len(FRAMES)
    assert [frame.pts for frame in frames] == list(range(len(FRAMES)))
    assert [frame.time for frame in frames] == pytest.approx([i / FPS for i in range(len(FRAMES))])
    assert duration == pytest.approx(len(FRAMES) / FPS)
    starts = set(np.cumsum([0, *split[:-1]]).tolist())
    assert [frame.key_frame for frame in frames] == [i in starts for i in range(len(FRAMES))]
    # crf 0 is lossless coding: all that is lost is in the colour conversion, which the bitstream tags
    # (BT.709, limited range) let the decoder undo exactly as we did it
    for frame, rgb in zip(frames, FRAMES, strict=True):
        np.testing.assert_array_equal(frame.to_ndarray(format="rgb24"), colour_round_trip(rgb))


def test_lossy_frames_stay_close_to_the_input():
    init, fragments = write(FRAMES, [1, 4, 4], crf=12)
    frames, _ = decode(init + b"".join(fragments))
    for frame, rgb in zip(frames, FRAMES, strict=True):
        decoded = frame.to_ndarray(format="rgb24").astype(int)
        # the colour round trip alone (limited range, 4:2:0, swscale's rounding) is ~1.8 levels off on these
        # gradients, and crf 12 adds under a level on smooth content (measured: 0.1-0.6)
        assert np.abs(decoded - colour_round_trip(rgb)).mean() < 1.0
        assert np.abs(decoded - rgb).mean() < 2.2


def test_same_frames_and_split_give_the_same_bytes_and_another_split_moves_the_keyframes():
    first, second = write(FRAMES, [1, 4, 4]), write(FRAMES, [1, 4, 4])
    assert first == second
    other = write(FRAMES, [3, 6])
    assert other[0] == first[0]  # same settings, same parameter sets
    assert b"".join(other[1]) != b"".join(first[1])
    keys = [
        [i for i, frame in enumerate(decode(init + b"".join(fragments))[0]) if frame.key_frame]
        for init, fragments in (first, other)
    ]
    assert keys == [[0, 1, 5], [0, 3]]


def test_bitrate_mode_spends_the_bits_it_is_given():
    # noise cannot be compressed much, so the rate decides the size (up to where x264 runs out of detail to keep)
    noise = np.random.default_rng(0).integers(0, 256, (16, H, W, 3), dtype=np.uint8)
    sizes = {}
    for bitrate in (50_000, 1_000_000):
        init, fragments = write(noise, [4, 4, 4, 4], crf=None, bitrate=bitrate)
        assert len(decode(init + b"".join(fragments))[0]) == 16
        sizes[bitrate] = sum(map(len, fragments))
    assert sizes[1_000_000] > 3 * sizes[50_000]


def test_duration_and_close():
    writer = FragmentedMp4(W, H, FPS)
    writer.fragment(FRAMES[:1])
    writer.fragment(FRAMES[1:4])
    assert writer.duration_s == pytest.approx(4 / FPS)
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.fragment(FRAMES[:1])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"crf": 20, "bitrate": 1_000_000}, "exactly one of crf and bitrate"),
        ({"crf": None}, "exactly one of crf and bitrate"),
        ({"crf": 52}, "crf must be within"),
        ({"width": 63}, "even width and height.*63x48"),
        ({"height": 47}, "even width and height.*64x47"),
        ({"width": 0}, "0x48"),
        ({"fps": 0}, "fps"),
        ({"preset": "warp"}, "libx264 refused 64x48"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        FragmentedMp4(**{"width": W, "height": H, "fps": FPS, **settings})


@pytest.mark.parametrize(
    "frames, message",
    [
        (FRAMES[:2].astype(np.float32), "uint8"),
        (FRAMES[0], r"\[T >= 1, 48, 64, 3\], not \[48, 64, 3\]"),
        (FRAMES[:0], r"not \[0, 48, 64, 3\]"),
        (FRAMES[:2, :, :32], r"not \[2, 48, 32, 3\]"),
        (np.zeros((1, H, W, 4), np.uint8), r"not \[1, 48, 64, 4\]"),
    ],
)
def test_bad_frames_are_refused(frames, message):
    writer = FragmentedMp4(W, H, FPS)
    with pytest.raises(ValueError, match=message):
        writer.fragment(frames)
    assert boxes(writer.fragment(FRAMES[:1]))[0][0] == b"moof"  # a refused call leaves the writer usable


def test_smallest_even_size_encodes():
    writer = FragmentedMp4(2, 2, FPS)
    frames, _ = decode(writer.init_segment() + writer.fragment(np.full((2, 2, 2, 3), 128, np.uint8)))
    assert [(frame.width, frame.height) for frame in frames] == [(2, 2), (2, 2)]


class _Encoder:
    """Stands in for libx264 to show what the writer does when the encoder breaks its promises."""

    def __init__(self, packets: list[bytes]):
        self.packets = packets

    def encode(self, frame):
        return self.packets


@pytest.mark.parametrize(
    "packets, message",
    [
        ([], "0 packets for 1 frames"),
        ([b"\x00\x00\x00\x01\x65\x88", b"\x00\x00\x00\x01\x41\x9a"], "2 packets for 1 frames"),
        ([b"\x00\x00\x00\x01\x41\x9a"], "IDR"),
    ],
)
def test_an_encoder_that_lags_or_skips_the_idr_fails_loudly(packets, message):
    writer = FragmentedMp4(W, H, FPS)
    writer._codec = _Encoder(packets)
    with pytest.raises(RuntimeError, match=message):
        writer.fragment(FRAMES[:1])
