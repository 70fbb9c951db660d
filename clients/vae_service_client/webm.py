"""Streamed `webm` answers: the wire format of `POST /decode` with `stream: true, output: "webm"`,
as vae_service_client.mp4 is for `mp4` (the same contract, another container).

HTTP body (`Content-Type: video/webm; codecs="vp9"`): a WebM (Matroska, VP9) written as the frames
decode: the EBML header, a Segment of unknown size, its Info and Tracks (the init segment), then
one Cluster per latent frame's worth of frames, each starting with a keyframe; then one Void
element (0xEC, which players skip) at the Segment's level whose payload is `vae-service:done`
followed by the stream's summary as JSON, or `vae-service:error` followed by `{type, field,
message}` when the decode failed after the first cluster went out. Everything before that element,
appended to a MediaSource SourceBuffer or written to a file, is the whole `webm` answer of the
frames it carries, byte for byte (with the exceptions mp4's module names).

gRPC `DecodeFrames` carries the same bytes in its chunks (`fragment`, an Mp4Fragment: the first
one begins with the init segment), then `done`.
"""

from __future__ import annotations

import json

from vae_service_client.mp4 import TrailerReader

WEBM_MEDIA_TYPE = "video/webm"
SEGMENT = 0x18538067  # the one element of unknown size in a stream: its children follow it
VOID = 0xEC


def _size_vint(size: int) -> bytes:
    for length in range(1, 9):
        if size < (1 << (7 * length)) - 1:  # all value bits set means "unknown"
            return ((1 << (7 * length)) | size).to_bytes(length, "big")
    raise ValueError(f"an EBML element of {size} bytes is too large")


def trailer(tag: bytes, fields: dict) -> bytes:
    """The stream's last element, a Void: `tag` (DONE_TAG or ERROR_TAG) and `fields` as JSON."""
    payload = tag + json.dumps(fields, separators=(",", ":")).encode()
    return bytes([VOID]) + _size_vint(len(payload)) + payload


def _vint(data: bytearray, at: int, max_length: int) -> tuple[int, int, int] | None:
    """(length, raw value with its marker, value without it) of the variable-length integer at `at`, or
    None while incomplete."""
    if at >= len(data):
        return None
    first = data[at]
    length = 9 - first.bit_length() if first else 9
    if length > max_length:
        raise ValueError(f"an EBML number of {length} bytes at {at}: not a webm stream")
    if len(data) - at < length:
        return None
    raw = int.from_bytes(data[at : at + length], "big")
    return length, raw, raw & ((1 << (7 * length)) - 1)


class ElementReader(TrailerReader):
    """Top-level EBML elements (the Segment's children as well: it is the one of unknown size) out of byte
    chunks of any size: media bytes are passed on as soon as an element is whole; the trailing
    vae-service Void is kept apart as the summary, or the error that `close` raises (after every
    media byte before it was passed on). BoxReader's interface."""

    container, unit = "webm", "an element"

    def feed(self, data: bytes) -> bytes:
        """The media bytes of every element `data` completes."""
        self._buffer += data
        media, start = bytearray(), 0
        while True:
            found = _vint(self._buffer, start, 4)  # element ids are 1..4 bytes, kept with their marker
            if found is None:
                break
            id_length, kind, _ = found
            found = _vint(self._buffer, start + id_length, 8)
            if found is None:
                break
            size_length, _, size = found
            header = id_length + size_length
            if size == (1 << (7 * size_length)) - 1:  # unknown size
                if kind != SEGMENT:
                    raise ValueError(f"an element {kind:#x} of unknown size: not a vae-service webm stream")
                media += self._buffer[start : start + header]  # its children come next, at this level
                start += header
                continue
            if len(self._buffer) - start < header + size:
                break
            if not (kind == VOID and self._keep(bytes(self._buffer[start + header : start + header + size]))):
                media += self._buffer[start : start + header + size]
            start += header + size
        del self._buffer[:start]
        return bytes(media)
