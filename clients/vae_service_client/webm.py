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

# the reader (and the element ids it looks for) lives below this module and mp4.py, which both hand it out
from vae_service_client.container_readers import SEGMENT as SEGMENT
from vae_service_client.container_readers import VOID
from vae_service_client.container_readers import ElementReader as ElementReader

WEBM_MEDIA_TYPE = "video/webm"


def _size_vint(size: int) -> bytes:
    for length in range(1, 9):
        if size < (1 << (7 * length)) - 1:  # all value bits set means "unknown"
            return ((1 << (7 * length)) | size).to_bytes(length, "big")
    raise ValueError(f"an EBML element of {size} bytes is too large")


def trailer(tag: bytes, fields: dict) -> bytes:
    """The stream's last element, a Void: `tag` (DONE_TAG or ERROR_TAG) and `fields` as JSON."""
    payload = tag + json.dumps(fields, separators=(",", ":")).encode()
    return bytes([VOID]) + _size_vint(len(payload)) + payload
