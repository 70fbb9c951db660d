"""WebM (Matroska, VP9) written cluster by cluster, for Media Source Extensions and players: an init segment
(EBML header, a Segment of unknown size, Info, Tracks; no frames), then one Cluster per call holding exactly
that call's frames. The same interface as engine/media/fmp4.py's FragmentedMp4, so the answer and its stream
are cut the same way: a fragment here is a Cluster.

    EBML header   EBMLVersion 1, DocType "webm" (DocTypeVersion 4, DocTypeReadVersion 2)
    Segment       size unknown (0x01FFFFFFFFFFFFFF): its children follow until the end of the file
      Info        TimecodeScale 1 ms, MuxingApp and WritingApp "vae-service"; no Duration (unknown while live)
      Tracks      one TrackEntry: track 1, video, V_VP9, DefaultDuration 1/fps s, no lacing, PixelWidth and
                  PixelHeight, Colour: BT.709 primaries, transfer and matrix, broadcast (limited) range, 8 bits
      Cluster     per fragment, its size known: Timecode (ms of its first frame), then one SimpleBlock per
      ...         frame (track 1, time relative to the cluster, the keyframe flag), the first a keyframe

libvpx-vp9 runs through PyAV's codec API (no container) and the elements are written here, so a cluster leaves
as soon as its frames are encoded (FFmpeg's webm muxer closes a cluster only when a later packet arrives).

- Latency: lag-in-frames 0 and no alternate reference frames give one packet per frame as the frame goes in;
  a cluster whose packet count differs from its frame count fails loudly rather than shipping misaligned
  frames. deadline=realtime with cpu-used = `speed` (8: fastest): about x264 veryfast's time here.
- Random access: the first frame of each cluster is a forced keyframe, and libvpx places no others
  (kf_max_dist unbounded; with no lag it has no lookahead to find scene cuts in).
- Determinism: one libvpx thread (no row-mt); the same frames in the same split give the same bytes.
- Timing: block times are milliseconds, frame n at round(n * 1000 / fps); DefaultDuration (ns) gives each
  frame its length. A SimpleBlock's time is an int16 relative to its cluster: a fragment longer than 32.767 s
  continues in another cluster (without a keyframe of its own).
- Colour: RGB becomes BT.709 limited-range YUV 4:2:0 (video_codec.yuv_frame, as for mp4), and both the VP9
  bitstream (colour space, range) and the track's Colour say so.

The encoder's set-up, the frame checks and the encode loop are video_codec.py's, shared with fmp4.py.

VP9 codes any size from 1x1 (odd sizes too: the chroma planes round up)."""

from __future__ import annotations

import struct

import numpy as np

from vae_service.engine.media.video_codec import VideoWriter, check_rate, open_encoder

# element ids (with their length markers, as written)
EBML = 0x1A45DFA3
EBML_VERSION, EBML_READ_VERSION, EBML_MAX_ID_LENGTH, EBML_MAX_SIZE_LENGTH = 0x4286, 0x42F7, 0x42F2, 0x42F3
DOC_TYPE, DOC_TYPE_VERSION, DOC_TYPE_READ_VERSION = 0x4282, 0x4287, 0x4285
SEGMENT = 0x18538067
INFO, TIMECODE_SCALE, MUXING_APP, WRITING_APP = 0x1549A966, 0x2AD7B1, 0x4D80, 0x5741
TRACKS, TRACK_ENTRY, TRACK_NUMBER, TRACK_UID, TRACK_TYPE = 0x1654AE6B, 0xAE, 0xD7, 0x73C5, 0x83
FLAG_LACING, LANGUAGE, CODEC_ID, DEFAULT_DURATION = 0x9C, 0x22B59C, 0x86, 0x23E383
VIDEO, PIXEL_WIDTH, PIXEL_HEIGHT = 0xE0, 0xB0, 0xBA
COLOUR, MATRIX_COEFFICIENTS, BITS_PER_CHANNEL = 0x55B0, 0x55B1, 0x55B2
RANGE, TRANSFER, PRIMARIES = 0x55B9, 0x55BA, 0x55BB
CLUSTER, TIMECODE, SIMPLE_BLOCK = 0x1F43B675, 0xE7, 0xA3

UNKNOWN_SIZE = b"\x01\xff\xff\xff\xff\xff\xff\xff"  # an 8-byte size with every value bit set
TIMECODE_SCALE_NS = 1_000_000  # block times in milliseconds
_KEYFRAME = 0x80  # SimpleBlock flags: keyframe; no lacing, not invisible, not discardable
_TRACK = 1
_MAX_RELATIVE_MS = 0x7FFF  # a SimpleBlock's time relative to its cluster is an int16
_BT709 = 1  # primaries, transfer and matrix alike (Matroska's codes are ISO/IEC 23091-4's, as FFmpeg's enums)
_BROADCAST_RANGE = 1  # Matroska's Range 1: broadcast (limited); FFmpeg's AVCOL_RANGE_MPEG is 1 too
_KF_MAX_DIST = 1 << 30  # libvpx's kf_max_dist (FFmpeg's gop_size, 12 unless set): no keyframes but forced ones


def element_id(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 7) // 8, "big")


def size_vint(size: int) -> bytes:
    """A data size as an EBML variable-length integer, the shortest that holds it (all ones means unknown)."""
    for length in range(1, 9):
        if size < (1 << (7 * length)) - 1:
            return ((1 << (7 * length)) | size).to_bytes(length, "big")
    raise ValueError(f"an EBML element of {size} bytes is too large")


def element(kind: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return element_id(kind) + size_vint(len(body)) + body


def uint(kind: int, value: int) -> bytes:
    return element(kind, value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big"))


def string(kind: int, value: str) -> bytes:
    return element(kind, value.encode("ascii"))


def frame_ms(index: int, fps: int) -> int:
    """Frame `index`'s time in milliseconds, rounded half up."""
    return (2000 * index + fps) // (2 * fps)


class ClusteredWebm(VideoWriter):
    """One VP9 track; init_segment() first, then fragment() per chunk of frames (one Cluster each). Not
    thread-safe."""

    codecs = "vp9"  # RFC 6381, as MSE's isTypeSupported('video/webm; codecs="vp9"') takes it
    encoder = "libvpx-vp9"
    lag_setting = "lag-in-frames"

    def __init__(
        self,
        width: int,
        height: int,
        fps: int,
        crf: int | None = 32,
        bitrate: int | None = None,
        speed: int = 8,
        threads: int = 1,
    ) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"VP9 needs a width and height of at least 1, not {width}x{height}")
        check_rate(fps, threads, crf, bitrate, max_crf=63)
        if not 0 <= speed <= 8:
            raise ValueError(f"speed (libvpx cpu-used) must be within 0..8, not {speed}")

        options = {
            "deadline": "realtime",
            "cpu-used": str(speed),
            "lag-in-frames": "0",  # a packet per frame as it goes in
            "auto-alt-ref": "0",  # no hidden alternate reference frames (they need lag anyway)
            "row-mt": "0",
        }
        # crf alone is constant quality (b=0); a bitrate alone is libvpx's VBR
        options.update({"crf": str(crf), "b": "0"} if crf is not None else {"b": str(bitrate)})
        codec = open_encoder(self.encoder, width, height, fps, threads, options, gop_size=_KF_MAX_DIST)
        super().__init__(width, height, fps, codec)
        self._init = self._build_init_segment()

    def fragment(self, frames: np.ndarray) -> bytes:
        """uint8 [T, H, W, 3] RGB, T >= 1 -> a Cluster holding exactly these T frames, the first a keyframe."""
        packets = self._encode(frames)
        if not packets[0].is_keyframe:
            raise RuntimeError("libvpx-vp9 did not start the cluster with a keyframe")

        clusters, blocks, start_ms = [], [], frame_ms(self._frames_written, self.fps)
        for index, packet in enumerate(packets):
            at_ms = frame_ms(self._frames_written + index, self.fps)
            if at_ms - start_ms > _MAX_RELATIVE_MS:
                clusters.append(element(CLUSTER, uint(TIMECODE, start_ms), *blocks))
                blocks, start_ms = [], at_ms
            flags = _KEYFRAME if packet.is_keyframe else 0
            header = size_vint(_TRACK) + struct.pack(">hB", at_ms - start_ms, flags)
            blocks.append(element(SIMPLE_BLOCK, header, bytes(packet)))
        clusters.append(element(CLUSTER, uint(TIMECODE, start_ms), *blocks))
        self._frames_written += len(frames)
        return b"".join(clusters)

    def _build_init_segment(self) -> bytes:
        header = element(
            EBML,
            uint(EBML_VERSION, 1),
            uint(EBML_READ_VERSION, 1),
            uint(EBML_MAX_ID_LENGTH, 4),
            uint(EBML_MAX_SIZE_LENGTH, 8),
            string(DOC_TYPE, "webm"),
            uint(DOC_TYPE_VERSION, 4),  # Colour is a version 4 element
            uint(DOC_TYPE_READ_VERSION, 2),  # SimpleBlock needs version 2 to read
        )
        info = element(
            INFO,
            uint(TIMECODE_SCALE, TIMECODE_SCALE_NS),
            string(MUXING_APP, "vae-service"),
            string(WRITING_APP, "vae-service"),
        )
        colour = element(
            COLOUR,
            uint(MATRIX_COEFFICIENTS, _BT709),
            uint(BITS_PER_CHANNEL, 8),
            uint(RANGE, _BROADCAST_RANGE),
            uint(TRANSFER, _BT709),
            uint(PRIMARIES, _BT709),
        )
        track = element(
            TRACK_ENTRY,
            uint(TRACK_NUMBER, _TRACK),
            uint(TRACK_UID, _TRACK),
            uint(TRACK_TYPE, 1),  # video
            uint(FLAG_LACING, 0),
            string(LANGUAGE, "und"),
            string(CODEC_ID, "V_VP9"),
            uint(DEFAULT_DURATION, round(1e9 / self.fps)),  # ns
            element(VIDEO, uint(PIXEL_WIDTH, self.width), uint(PIXEL_HEIGHT, self.height), colour),
        )
        return header + element_id(SEGMENT) + UNKNOWN_SIZE + info + element(TRACKS, track)
