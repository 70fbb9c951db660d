"""Streamed `mp4` answers: the wire format of `POST /decode` with `stream: true, output: "mp4"`
and how a client writes one to a file as it arrives.

HTTP body (`Content-Type: video/mp4; codecs="avc1.…"`): a fragmented MP4, written as the frames
decode: the init segment (`ftyp`, `moov`), then one `moof` + `mdat` fragment per latent frame's
worth of frames, each starting with a keyframe; then one top-level `free` box (which players skip)
whose payload is `vae-service:done` followed by the stream's summary as JSON (model, quality,
precision, request_id, timing, tiled, fallback[, fallback_from_frame][, retried_from_frame]), or
`vae-service:error` followed by `{type, field, message}` when the decode failed after the first
fragment went out. Everything before that box, appended to a MediaSource SourceBuffer or written to
a file, is the whole `mp4` answer of the frames it carries, byte for byte: of the same request,
except where its item fell back to fp32 after fragments went out (`fallback_from_frame` above 0:
the fragments before that frame are the first decode's, as sent; see frames.py).

gRPC `DecodeFrames` carries the same bytes in its chunks (`fragment`: the first one begins with the
init segment), then `done`.

Output "webm" streams the same way in WebM (VP9), a Cluster per fragment, closed by a Void element
in place of the `free` box (vae_service_client.webm); `write_chunks(..., output="webm")` reads it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from vae_service_client.errors import make_error

MP4_MEDIA_TYPE = "video/mp4"
TRAILER_BOX = b"free"
DONE_TAG, ERROR_TAG = b"vae-service:done", b"vae-service:error"
_HEADER = struct.Struct(">I4s")


def trailer(tag: bytes, fields: dict) -> bytes:
    """The stream's last box: `tag` (DONE_TAG or ERROR_TAG) and `fields` as JSON."""
    payload = tag + json.dumps(fields, separators=(",", ":")).encode()
    return _HEADER.pack(_HEADER.size + len(payload), TRAILER_BOX) + payload


@dataclass(frozen=True)
class Mp4Fragment:
    """Frames `frame`.. (`frames` of them) of an mp4 (or webm: a Cluster) stream as bytes to append (the
    first one begins with the init segment): a DecodeFrames chunk, or a replica's VideoStream event."""

    frame: int
    frames: int
    data: bytes


class TrailerReader:
    """What BoxReader and webm.ElementReader share: the bytes not yet whole, and the trailing vae-service
    box (element) kept apart as the summary, or the error that `close` raises (after every media byte
    before it was passed on). A subclass's `feed` passes each whole trailer's payload to `_keep`."""

    container = ""  # "mp4", "webm": for close's errors
    unit = ""  # "a box", "an element"

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.summary: dict | None = None
        self._error: dict | None = None

    def _keep(self, payload: bytes) -> bool:
        """Keeps a trailer payload's summary or error; False if it is neither (media, then)."""
        if payload.startswith(ERROR_TAG):
            self._error = json.loads(payload[len(ERROR_TAG) :])
        elif payload.startswith(DONE_TAG):
            self.summary = json.loads(payload[len(DONE_TAG) :])
        else:
            return False
        return True

    def close(self) -> dict:
        """The summary; raises the stream's error, or if it ended before its summary (cut off, or
        inside a box or element)."""
        if self._error is not None:
            err = self._error
            raise make_error(err.get("type", "internal"), err.get("field"), err.get("message", ""))
        if self._buffer:
            raise make_error(
                "unavailable",
                None,
                f"the {self.container} stream ended inside {self.unit} ({len(self._buffer)} bytes left)",
            )
        if self.summary is None:
            raise make_error("unavailable", None, f"the {self.container} stream ended before its summary")
        return self.summary


class BoxReader(TrailerReader):
    """Top-level ISO BMFF boxes out of byte chunks of any size: media bytes are passed on as soon as
    a box is whole; the trailing vae-service box is kept apart as the summary, or the error that
    `close` raises (after every media byte before it was passed on)."""

    container, unit = "mp4", "a box"

    def feed(self, data: bytes) -> bytes:
        """The media bytes of every box `data` completes."""
        self._buffer += data
        media, start = bytearray(), 0
        while len(self._buffer) - start >= _HEADER.size:
            size, kind = _HEADER.unpack_from(self._buffer, start)
            header = _HEADER.size
            if size == 1:  # a 64-bit size follows the type
                if len(self._buffer) - start < 16:
                    break
                (size,) = struct.unpack_from(">Q", self._buffer, start + 8)
                header = 16
            if size < header:
                raise ValueError(f"a {kind!r} box of {size} bytes: not an mp4 stream")
            if len(self._buffer) - start < size:
                break
            box = bytes(self._buffer[start : start + size])
            start += size
            if not (kind == TRAILER_BOX and self._keep(box[header:])):
                media += box
        del self._buffer[:start]
        return bytes(media)


def _open(target: str | Path | BinaryIO) -> tuple[BinaryIO, bool]:
    if isinstance(target, str | Path):
        return open(target, "wb"), True  # closed by the caller
    return target, False


def stream_reader(output: str = "mp4"):
    """The reader of a streamed video's body: BoxReader for mp4, webm.ElementReader for webm."""
    from vae_service_client.webm import ElementReader  # webm imports this module (TrailerReader)

    readers = {"mp4": BoxReader, "webm": ElementReader}
    if output not in readers:
        raise ValueError(f"output {output!r} is not a streamed video ({', '.join(readers)})")
    return readers[output]()


def write_chunks(chunks: Iterable[bytes], target: str | Path | BinaryIO, output: str = "mp4") -> dict:
    """A video stream's body chunks (`output` mp4 or webm) -> `target` (a path or a binary file), each
    box (element) written and flushed as soon as it is whole; returns the summary."""
    out, owned = _open(target)
    reader = stream_reader(output)
    try:
        for data in chunks:
            _write(out, reader.feed(data))
        return reader.close()
    finally:
        if owned:
            out.close()


async def write_chunks_async(chunks: AsyncIterable[bytes], target: str | Path | BinaryIO, output: str = "mp4") -> dict:
    out, owned = _open(target)
    reader = stream_reader(output)
    try:
        async for data in chunks:
            _write(out, reader.feed(data))
        return reader.close()
    finally:
        if owned:
            out.close()


def _write(out: BinaryIO, media: bytes) -> None:
    if media:
        out.write(media)
        out.flush()  # a player reading the file follows the decode


def write_fragments(fragments: Iterable[Mp4Fragment], target: str | Path | BinaryIO) -> None:
    """gRPC DecodeFrames' Mp4Fragments -> `target`, each written and flushed as it arrives."""
    out, owned = _open(target)
    try:
        for fragment in fragments:
            _write(out, fragment.data)
    finally:
        if owned:
            out.close()


async def write_fragments_async(fragments: AsyncIterable[Mp4Fragment], target: str | Path | BinaryIO) -> None:
    out, owned = _open(target)
    try:
        async for fragment in fragments:
            _write(out, fragment.data)
    finally:
        if owned:
            out.close()
