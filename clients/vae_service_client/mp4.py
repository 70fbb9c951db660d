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
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# the readers (and the trailer's tags) live below this module and webm.py, which both hand them out
from vae_service_client.container_readers import BOX_HEADER, TRAILER_BOX, BoxReader, ElementReader
from vae_service_client.container_readers import DONE_TAG as DONE_TAG
from vae_service_client.container_readers import ERROR_TAG as ERROR_TAG
from vae_service_client.container_readers import TrailerReader as TrailerReader

MP4_MEDIA_TYPE = "video/mp4"


def trailer(tag: bytes, fields: dict) -> bytes:
    """The stream's last box: `tag` (DONE_TAG or ERROR_TAG) and `fields` as JSON."""
    payload = tag + json.dumps(fields, separators=(",", ":")).encode()
    return BOX_HEADER.pack(BOX_HEADER.size + len(payload), TRAILER_BOX) + payload


@dataclass(frozen=True)
class Mp4Fragment:
    """Frames `frame`.. (`frames` of them) of an mp4 (or webm: a Cluster) stream as bytes to append (the
    first one begins with the init segment): a DecodeFrames chunk, or a replica's VideoStream event."""

    frame: int
    frames: int
    data: bytes


def _open(target: str | Path | BinaryIO) -> tuple[BinaryIO, bool]:
    if isinstance(target, str | Path):
        return open(target, "wb"), True  # closed by the caller
    return target, False


def stream_reader(output: str = "mp4"):
    """The reader of a streamed video's body: BoxReader for mp4, ElementReader for webm."""
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
