"""Fragmented MP4 (ISO BMFF, H.264) written chunk by chunk, for Media Source Extensions and players: an init
segment (ftyp + moov, no samples), then one moof + mdat fragment per call holding exactly that call's frames.

FFmpeg's mov muxer, even with movflags frag_keyframe+empty_moov, only closes a fragment when the next packet
arrives, so every fragment would wait for the next chunk. Here libx264 runs through PyAV's codec API (no
container) and the boxes are written by hand, so a fragment leaves as soon as its frames are encoded.

- Latency: tune=zerolatency (no B-frames, no lookahead) gives one packet per frame as the frame goes in; a
  fragment whose packet count differs from its frame count fails loudly rather than shipping misaligned samples.
- Random access: the first frame of each fragment is forced to an IDR and no other keyframes are allowed
  (keyint=infinite, scenecut off), so keyframes fall where the caller split the chunks and nowhere else.
- Determinism: x264's thread count is fixed; the same frames in the same split give the same bytes.
- Timing: timescale = fps and every sample lasts 1 tick, so decode time = presentation time = frame index.
- Colour: RGB becomes BT.709 limited-range YUV 4:2:0 and the SPS says so; left unsaid, browsers guess
  (often BT.709) while libswscale converts with BT.601, and colours would shift.

The encoder's set-up, the frame checks and the encode loop are video_codec.py's, shared with webm.py.

libx264 extradata (SPS, PPS) and packets come in Annex B form (start codes); the avcC box and the samples use
4-byte length prefixes instead. libx264 accepts any even size from 2x2 and refuses odd ones (4:2:0)."""

from __future__ import annotations

import struct

import numpy as np

from vae_service.engine.media.video_codec import VideoWriter, check_rate, open_encoder

_NAL_IDR = 5
_NAL_SPS = 7
_NAL_PPS = 8
_NAL_AUD = 9
# avcC only carries chroma format and bit depths for profiles other than Baseline (66), Main (77), Extended (88)
_PROFILES_WITHOUT_AVCC_EXT = (66, 77, 88)

_SYNC_SAMPLE = 2 << 24  # sample_depends_on = 2: depends on no other sample
_NON_SYNC_SAMPLE = 1 << 24 | 1 << 16  # sample_depends_on = 1, sample_is_non_sync_sample = 1

_UNITY_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)


def _box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *parts: bytes) -> bytes:
    return _box(kind, struct.pack(">I", version << 24 | flags), *parts)


def _nal_units(annex_b: bytes) -> list[bytes]:
    """Annex B -> NAL units. Emulation prevention keeps 00 00 01 out of NAL payloads, and a NAL unit ends in
    a non-zero byte (the RBSP stop bit, or cabac_zero_words' 03), so the zeros stripped belong to start codes."""
    return [unit.rstrip(b"\x00") for unit in annex_b.split(b"\x00\x00\x01") if unit.rstrip(b"\x00")]


def _nal_type(unit: bytes) -> int:
    return unit[0] & 0x1F


class FragmentedMp4(VideoWriter):
    """One H.264 track; init_segment() first, then fragment() per chunk of frames. Not thread-safe."""

    encoder = "libx264"
    lag_setting = "zerolatency"

    def __init__(
        self,
        width: int,
        height: int,
        fps: int,
        crf: int | None = 23,
        bitrate: int | None = None,
        preset: str = "veryfast",
        threads: int = 1,
    ) -> None:
        if width < 2 or height < 2 or width % 2 or height % 2:
            raise ValueError(f"libx264 (yuv420p) needs an even width and height of at least 2, not {width}x{height}")
        check_rate(fps, threads, crf, bitrate, max_crf=51)

        options = {
            "tune": "zerolatency",
            "preset": preset,
            "forced-idr": "1",  # a forced I frame is an IDR, not a mere I frame that later frames may skip past
            "x264-params": "keyint=infinite:scenecut=0",
        }
        options.update({"crf": str(crf)} if crf is not None else {"b": str(bitrate)})
        # global header: SPS/PPS once, as extradata, for avcC
        codec = open_encoder(self.encoder, width, height, fps, threads, options, global_header=True)
        super().__init__(width, height, fps, codec)

        units = _nal_units(bytes(codec.extradata or b""))
        sps = [unit for unit in units if _nal_type(unit) == _NAL_SPS]
        pps = [unit for unit in units if _nal_type(unit) == _NAL_PPS]
        if len(sps) != 1 or len(pps) != 1:
            raise RuntimeError(f"libx264 extradata holds {len(sps)} SPS and {len(pps)} PPS, not one of each")
        self._sps, self._pps = sps[0], pps[0]
        self.codecs = f"avc1.{self._sps[1:4].hex()}"
        self._init = self._build_init_segment()
        self._sequence = 0

    def resume(self, frames: int, fragments: int) -> None:
        super().resume(frames, fragments)
        self._sequence = fragments

    def fragment(self, frames: np.ndarray) -> bytes:
        """uint8 [T, H, W, 3] RGB, T >= 1 -> moof + mdat holding exactly these T frames, the first an IDR."""
        samples = [bytes(packet) for packet in self._encode(frames)]
        sample_units = [_nal_units(sample) for sample in samples]
        key = [any(_nal_type(unit) == _NAL_IDR for unit in units) for units in sample_units]
        if not key[0]:
            raise RuntimeError("libx264 did not start the fragment with an IDR frame")
        # parameter sets are in avcC, and access unit delimiters mean nothing between length prefixes
        payloads = [
            b"".join(
                struct.pack(">I", len(unit)) + unit
                for unit in units
                if _nal_type(unit) not in (_NAL_SPS, _NAL_PPS, _NAL_AUD)
            )
            for units in sample_units
        ]

        self._sequence += 1
        moof = self._build_moof(payloads, key, data_offset=0)
        moof = self._build_moof(payloads, key, data_offset=len(moof) + 8)  # the offset does not change the size
        self._frames_written += len(frames)
        return moof + _box(b"mdat", *payloads)

    def _build_moof(self, payloads: list[bytes], key: list[bool], data_offset: int) -> bytes:
        trun_flags = 0x000001 | 0x000100 | 0x000200 | 0x000400  # data offset; per-sample duration, size, flags
        entries = b"".join(
            struct.pack(">III", 1, len(payload), _SYNC_SAMPLE if is_key else _NON_SYNC_SAMPLE)
            for payload, is_key in zip(payloads, key, strict=True)
        )
        traf = _box(
            b"traf",
            _full_box(b"tfhd", 0, 0x020000, struct.pack(">I", 1)),  # default-base-is-moof: offsets from moof
            _full_box(b"tfdt", 1, 0, struct.pack(">Q", self._frames_written)),
            _full_box(b"trun", 0, trun_flags, struct.pack(">Ii", len(payloads), data_offset), entries),
        )
        return _box(b"moof", _full_box(b"mfhd", 0, 0, struct.pack(">I", self._sequence)), traf)

    def _build_init_segment(self) -> bytes:
        ftyp = _box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isom", b"iso6", b"avc1", b"mp41")
        mvhd = _full_box(
            b"mvhd",
            0,
            0,
            struct.pack(">IIII", 0, 0, 1000, 0),  # created, modified, timescale, duration: unknown while live
            struct.pack(">IH10x", 0x10000, 0x100),  # rate 1.0, volume 1.0
            _UNITY_MATRIX,
            bytes(24),
            struct.pack(">I", 2),  # next track id
        )
        tkhd = _full_box(
            b"tkhd",
            0,
            3,  # enabled, in movie
            struct.pack(">IIIII", 0, 0, 1, 0, 0),  # created, modified, track id, reserved, duration
            bytes(8),
            struct.pack(">hhhH", 0, 0, 0, 0),  # layer, alternate group, volume (none for video), reserved
            _UNITY_MATRIX,
            struct.pack(">II", self.width << 16, self.height << 16),
        )
        und = (ord("u") - 0x60) << 10 | (ord("n") - 0x60) << 5 | (ord("d") - 0x60)
        mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, self.fps, 0, und, 0))
        hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), b"VideoHandler\x00")
        dinf = _box(b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 1)))
        stbl = _box(
            b"stbl",
            _full_box(b"stsd", 0, 0, struct.pack(">I", 1), self._avc1()),
            _full_box(b"stts", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
            _full_box(b"stco", 0, 0, struct.pack(">I", 0)),
        )
        minf = _box(b"minf", _full_box(b"vmhd", 0, 1, bytes(8)), dinf, stbl)
        trak = _box(b"trak", tkhd, _box(b"mdia", mdhd, hdlr, minf))
        trex = _full_box(b"trex", 0, 0, struct.pack(">IIIII", 1, 1, 0, 0, 0))  # track 1, sample description 1
        return ftyp + _box(b"moov", mvhd, trak, _box(b"mvex", trex))

    def _avc1(self) -> bytes:
        sps, pps = self._sps, self._pps
        avcc = struct.pack(">BBBBBBH", 1, sps[1], sps[2], sps[3], 0xFC | 3, 0xE0 | 1, len(sps)) + sps
        avcc += struct.pack(">BH", 1, len(pps)) + pps
        if sps[1] not in _PROFILES_WITHOUT_AVCC_EXT:
            # chroma_format_idc 1 (4:2:0), 8-bit luma and chroma: what yuv420p fixes; no SPS extensions
            avcc += struct.pack(">BBBB", 0xFC | 1, 0xF8 | 0, 0xF8 | 0, 0)
        return _box(
            b"avc1",
            bytes(6),
            struct.pack(">H", 1),  # data reference index
            bytes(16),
            struct.pack(">HH", self.width, self.height),
            struct.pack(">II", 0x480000, 0x480000),  # 72 dpi
            struct.pack(">IH", 0, 1),  # reserved, one frame per sample
            bytes(32),  # no compressor name
            struct.pack(">Hh", 0x18, -1),  # depth: colour without alpha; pre_defined
            _box(b"avcC", avcc),
        )
