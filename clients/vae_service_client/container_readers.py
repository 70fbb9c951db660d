"""The readers of a streamed video's body, one per container, below mp4.py and webm.py (which both
hand them out): each passes the media bytes on as soon as a box (mp4) or element (webm) is whole and
keeps the trailing vae-service box or element apart as the stream's summary, or the error that
`close` raises. The wire formats are mp4.py's and webm.py's docstrings; the trailer's tags and the
container ids the readers look for are defined here, once."""

from __future__ import annotations

import json
import struct

from vae_service_client.errors import make_error

DONE_TAG, ERROR_TAG = b"vae-service:done", b"vae-service:error"
TRAILER_BOX = b"free"  # mp4: the top-level box the trailer travels in
BOX_HEADER = struct.Struct(">I4s")  # mp4: a box's 32-bit size and type
SEGMENT = 0x18538067  # webm: the one element of unknown size in a stream: its children follow it
VOID = 0xEC  # webm: the element the trailer travels in


class TrailerReader:
    """What BoxReader and ElementReader share: the bytes not yet whole, and the trailing vae-service
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
        while len(self._buffer) - start >= BOX_HEADER.size:
            size, kind = BOX_HEADER.unpack_from(self._buffer, start)
            header = BOX_HEADER.size
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


def _vint(data: bytearray, at: int, max_length: int) -> tuple[int, int, int] | None:
    """(length, raw value with its marker, value without it) of the EBML variable-length integer at
    `at`, or None while incomplete."""
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
