"""Streamed video frames: the wire format of `POST /decode` with `stream: true` and of gRPC
`DecodeFrames` (vae_service.v1.FrameMessage: a `chunk` or `done`), and what clients read from them.

HTTP body (media type STREAM_MEDIA_TYPE): a sequence of messages, each a 4-byte big-endian
unsigned length followed by that many bytes of one msgpack map, one of:

- `{"item": i, "frame": f, "pixels": tensor}`: frames f.. of batch items i.. (uint8
  [n, t, H, W, 3] or float [n, 3, t, H, W]), sent as soon as their latent frame is decoded;
- `{"done": {model, quality, precision, request_id, timing, tiled, fallback[, fallback_from_frame]
  [, retried_from_frame]}}`: the last message; `retried_from_frame` when the decode failed after
  frames went out and ran again (out of device memory: in tiles; an item whose fp16/bf16 output
  overflowed: in fp32, its index in `fallback`): every item's frames before it came from the first
  attempt, later ones from the retry (`high`: all of them; items decoded alone: those the first
  attempt had not sent). `fallback_from_frame` (with a non-empty `fallback`, one per item in it):
  that item's first frame decoded in fp32; its frames before it went out from the first decode
  (finite, at the deployment's precision), and `precision` is "fp32" only when every frame sent
  was fp32;
- `{"error": {type, field, message}}`: the decode failed after frames were sent (the last message).

Errors found before the first frame are ordinary HTTP errors (JSON, 4xx/5xx). No frame is sent
twice or taken back: the frames of every item concatenated along the frame axis are the answer,
bit for bit the non-streamed output, except an item in `fallback` whose `fallback_from_frame` is
above 0: its frames from that one on are the non-streamed output's (fp32), those before it the
first decode's.

Output "mp4" streams a fragmented MP4 instead (vae_service_client.mp4); over gRPC its chunks carry
`fragment` bytes (Mp4Fragment here) in place of a tensor.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field

import msgpack
import numpy as np

from vae_service_client.errors import make_error
from vae_service_client.messages import (
    pack,
    tensor_map_of_proto,
    tensor_proto,
    timing_of_proto,
    timing_proto,
)
from vae_service_client.mp4 import Mp4Fragment
from vae_service_client.tensors import decode_tensor, encode_tensor

STREAM_MEDIA_TYPE = "application/vnd.vae-service.frames+msgpack"
_LENGTH = struct.Struct(">I")
MAX_MESSAGE_BYTES = 2**31  # a message longer than this is a broken stream, not a frame


@dataclass(frozen=True)
class FrameChunk:
    item: int  # first batch item
    frame: int  # first frame, within each item
    pixels: np.ndarray  # uint8 [n, t, H, W, 3] or float [n, 3, t, H, W]

    @property
    def frame_axis(self) -> int:
        return 1 if self.pixels.dtype == np.uint8 else 2


def framed(message: dict) -> bytes:
    body = pack(message)
    return _LENGTH.pack(len(body)) + body


def frames_message(item: int, frame: int, pixels) -> dict:
    return {"item": item, "frame": frame, "pixels": encode_tensor(pixels)}


def frame_message_proto(message: dict):
    """The HTTP stream's frames or `done` map (`pixels` a tensor, array or tensor map) as a
    DecodeFrames message (vae_service.v1.FrameMessage)."""
    from vae_service_client.grpc_gen import decode_pb2

    if "done" in message:
        done = message["done"]
        msg = decode_pb2.Done(
            model=done["model"],
            quality=done["quality"],
            precision=done["precision"],
            request_id=done.get("request_id") or "",
            timing=timing_proto(done["timing"]),
            tiled=done.get("tiled", False),
            fallback=done.get("fallback", []),
            fallback_from_frame=done.get("fallback_from_frame", []),
        )
        if done.get("retried_from_frame") is not None:
            msg.retried_from_frame = done["retried_from_frame"]
        return decode_pb2.FrameMessage(done=msg)
    if "fragment" in message:
        chunk = decode_pb2.FrameChunk(
            item_index=message["item"],
            frame_start=message["frame"],
            fragment=message["fragment"],
            frames=message["frames"],
        )
        return decode_pb2.FrameMessage(chunk=chunk)
    pixels = message["pixels"]
    tensor = tensor_proto(encoded=pixels) if isinstance(pixels, dict) else tensor_proto(pixels)
    chunk = decode_pb2.FrameChunk(item_index=message["item"], frame_start=message["frame"], tensor=tensor)
    return decode_pb2.FrameMessage(chunk=chunk)


def message_of_proto(msg) -> dict | None:
    """A DecodeFrames message as the HTTP stream's map; None for the empty message that carries a
    failed stream's status (its status raises on the next read)."""
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        chunk = msg.chunk
        where = {"item": chunk.item_index, "frame": chunk.frame_start}
        if not chunk.HasField("tensor"):
            return {**where, "fragment": chunk.fragment, "frames": chunk.frames}
        return {**where, "pixels": tensor_map_of_proto(chunk.tensor)}
    if kind == "done":
        done = msg.done
        summary = {
            "model": done.model,
            "quality": done.quality,
            "precision": done.precision,
            "request_id": done.request_id or None,
            "timing": timing_of_proto(done.timing),
            "tiled": done.tiled,
            "fallback": list(done.fallback),
        }
        if done.fallback_from_frame:  # servers before it send none
            summary["fallback_from_frame"] = list(done.fallback_from_frame)
        if done.HasField("retried_from_frame"):
            summary["retried_from_frame"] = done.retried_from_frame
        return {"done": summary}
    return None


class MessageReader:
    """Length-prefixed msgpack messages out of byte chunks of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_MESSAGE_BYTES:
                raise ValueError(f"stream message of {length} bytes: not a vae-service frame stream")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            messages.append(msgpack.unpackb(bytes(self._buffer[_LENGTH.size : end]), raw=False))
            del self._buffer[:end]
        return messages

    def close(self) -> None:
        if self._buffer:
            # cut off mid-message (a body that ends with the connection): typed like a cut mp4 stream
            raise make_error(
                "unavailable", None, f"the frame stream ended inside a message ({len(self._buffer)} bytes left)"
            )


@dataclass
class StreamSummary:
    """What the last message says: model, quality, precision, request_id, timing, tiled, fallback,
    fallback_from_frame, and retried_from_frame (None unless the decode was retried after frames
    went out)."""

    fields: dict = field(default_factory=dict)

    @property
    def retried_from_frame(self) -> int | None:
        return self.fields.get("retried_from_frame")

    @property
    def fallback_from_frame(self) -> list[int]:
        """Per item in `fallback`, its first frame decoded in fp32: the frames before it were sent
        from the first decode (at the deployment's precision). A server before this field said
        only `retried_from_frame` (or nothing: every frame fp32)."""
        if "fallback_from_frame" in self.fields:
            return list(self.fields["fallback_from_frame"])
        return [self.fields.get("retried_from_frame") or 0] * len(self.fields.get("fallback", []))

    def __getattr__(self, name: str):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None


def chunk_of(message: dict, summary: StreamSummary) -> FrameChunk | Mp4Fragment | None:
    """A frames message -> FrameChunk (an mp4 stream's: Mp4Fragment); the done message fills
    `summary`; an error message raises."""
    if "error" in message:
        err = message["error"]
        raise make_error(err.get("type", "internal"), err.get("field"), err.get("message", ""))
    if "done" in message:
        summary.fields = message["done"]
        return None
    if "fragment" in message:
        return Mp4Fragment(message["frame"], message["frames"], message["fragment"])
    pixels = message["pixels"]  # a tensor map off the wire; an array from a Serve handle
    if not isinstance(pixels, np.ndarray):
        pixels = decode_tensor(pixels, "pixels").to_numpy()
    return FrameChunk(message["item"], message["frame"], pixels)


class FrameStream:
    """Iterate for FrameChunks as they arrive; `summary` is filled once the stream ended."""

    def __init__(self, messages: Iterable[dict]):
        self._messages = messages
        self.summary = StreamSummary()

    def __iter__(self) -> Iterator[FrameChunk]:
        for message in self._messages:
            chunk = chunk_of(message, self.summary)
            if chunk is not None:
                yield chunk
        if not self.summary.fields:
            raise make_error("unavailable", None, "the frame stream ended before its last message")

    def collect(self) -> np.ndarray:
        return assemble(self)


class AsyncFrameStream:
    def __init__(self, messages: AsyncIterator[dict]):
        self._messages = messages
        self.summary = StreamSummary()

    async def __aiter__(self) -> AsyncIterator[FrameChunk]:
        async for message in self._messages:
            chunk = chunk_of(message, self.summary)
            if chunk is not None:
                yield chunk
        if not self.summary.fields:
            raise make_error("unavailable", None, "the frame stream ended before its last message")

    async def collect(self) -> np.ndarray:
        return assemble([c async for c in self])


def assemble(chunks: Iterable[FrameChunk]) -> np.ndarray:
    """The whole output from its chunks (what the same request answers without streaming)."""
    items: dict[int, list[FrameChunk]] = {}
    for chunk in chunks:
        items.setdefault(chunk.item, []).append(chunk)
    blocks = []
    for item in sorted(items):
        parts = sorted(items[item], key=lambda c: c.frame)
        blocks.append(np.concatenate([c.pixels for c in parts], axis=parts[0].frame_axis))
    return np.concatenate(blocks, axis=0)
