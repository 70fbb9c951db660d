"""Streamed frames on the wire (vae_service_client.frames): an engine FrameChunk or the request's
final DecodeResult -> one length-prefixed msgpack message (HTTP) or one DecodeResponse (gRPC)."""

from __future__ import annotations

from vae_service.engine.result import DecodeResult
from vae_service.engine.video import FrameChunk
from vae_service.protocol.errors import WireErrorInfo
from vae_service.protocol.msgpack_decode import response_of
from vae_service_client.frames import framed, frames_message
from vae_service_client.messages import tensor_proto


def http_message(event: FrameChunk | DecodeResult) -> bytes:
    if isinstance(event, FrameChunk):
        return framed(frames_message(event.item, event.frame, event.pixels))
    return framed({"done": response_of(event).summary()})


def http_error_message(info: WireErrorInfo) -> bytes:
    return framed({"error": {"type": info.type, "field": info.field, "message": info.message}})


def grpc_message(event: FrameChunk | DecodeResult):
    from vae_service_client.grpc_gen import decode_pb2

    if isinstance(event, FrameChunk):
        pixels = tensor_proto(event.pixels)
        return decode_pb2.DecodeResponse(tensor=pixels, item_index=event.item, frame_start=event.frame)
    msg = response_of(event).to_proto()
    msg.done = True
    return msg
