"""The engine's answers -> every way out: a DecodeResult as a msgpack /decode body, gRPC
DecodeResponse messages (Decode, and DecodeStream's one per batch item) or a handle's dict; a
streamed request's FrameChunks and final result as the HTTP stream's messages or gRPC
DecodeFrames messages. The wire schema is vae_service_client's (messages, frames)."""

from __future__ import annotations

from dataclasses import fields

from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.request.result import DecodeResult
from vae_service.protocol.errors import WireErrorInfo
from vae_service.protocol.tensors import to_numpy
from vae_service_client import mp4, webm
from vae_service_client.frames import frame_message_proto, framed, frames_message
from vae_service_client.messages import MSGPACK, DecodeResponse, pack
from vae_service_client.mp4 import DONE_TAG, ERROR_TAG, Mp4Fragment

CONTENT_TYPE = MSGPACK  # of a whole /decode answer


def response_of(result: DecodeResult, output=None, item_index: int = 0) -> DecodeResponse:
    """The wire response for a result (`output` overrides it, e.g. one batch item)."""
    t = result.timing
    timing = {
        "queue_ms": round(t.queue_ms, 3),
        "decode_ms": round(t.decode_ms, 3),
        "encode_ms": round(t.encode_ms, 3),
        "batch_size": t.batch_size,
        "replicas": t.replicas,
        "preempted_ms": round(t.preempted_ms, 3),
    }
    return DecodeResponse(
        result.output if output is None else output,
        result.model,
        result.quality,
        result.precision,
        result.request_id,
        timing,
        item_index,
        result.tiled,
        result.retried_from_frame,
        list(result.fallback),
    )


# ---- whole answers -----------------------------------------------------------------------------
def msgpack_response(result: DecodeResult) -> bytes:
    return pack(response_of(result).to_map())


def grpc_response(result: DecodeResult):
    return response_of(result).to_proto()


def grpc_item_responses(result: DecodeResult) -> list:
    """DecodeStream: one DecodeResponse per batch item, in order."""
    out = result.output
    items = [[f] for f in out] if isinstance(out, list) else out.split(1)
    return [response_of(result, item, i).to_proto() for i, item in enumerate(items)]


def handle_response(result: DecodeResult) -> dict:
    """The /decode response fields, `output` a numpy array (bf16 as float32) or a list of bytes."""
    out = result.output if isinstance(result.output, list) else to_numpy(result.output)
    response = response_of(result, out)
    return {f.name: getattr(response, f.name) for f in fields(response) if f.name != "item_index"}


# ---- streamed frames: chunks as decoded, then the result (output None) -------------------------
StreamEvent = FrameChunk | Mp4Fragment | DecodeResult


def stream_message(event: StreamEvent) -> dict:
    """The HTTP stream's map (vae_service_client.frames) for an event; an mp4 stream's fragment
    as the map of a DecodeFrames chunk that carries one."""
    if isinstance(event, FrameChunk):
        return frames_message(event.item, event.frame, event.pixels)
    if isinstance(event, Mp4Fragment):
        return {"item": 0, "frame": event.frame, "frames": event.frames, "fragment": event.data}
    return {"done": done_summary(event)}


def done_summary(result: DecodeResult) -> dict:
    """A stream's last message: the response fields but `output`, and where an item fell back to
    fp32, from which of its frames the frames sent are fp32 (`fallback_from_frame`, beside `fallback`)."""
    summary = response_of(result).summary()
    if result.fallback and result.fallback_from_frame is not None:
        summary["fallback_from_frame"] = list(result.fallback_from_frame)
    return summary


# the closing element of a streamed video: mp4's `free` box, webm's Void element
TRAILERS = {"mp4": mp4.trailer, "webm": webm.trailer}


def video_stream_bytes(event: Mp4Fragment | DecodeResult, output: str) -> bytes:
    """An HTTP video stream's next bytes (vae_service_client.mp4, .webm): a fragment, or the summary's
    closing box (element)."""
    if isinstance(event, Mp4Fragment):
        return event.data
    return TRAILERS[output](DONE_TAG, done_summary(event))


def video_error_bytes(info: WireErrorInfo, output: str) -> bytes:
    return TRAILERS[output](ERROR_TAG, {"type": info.type, "field": info.field, "message": info.message})


def http_frame_message(event: StreamEvent) -> bytes:
    return framed(stream_message(event))


def http_error_message(info: WireErrorInfo) -> bytes:
    return framed({"error": {"type": info.type, "field": info.field, "message": info.message}})


def handle_frame_message(event: StreamEvent) -> dict:
    """A streaming handle's item: {item, frame, pixels (numpy)}, an mp4 stream's {item, frame,
    frames, fragment (bytes)}, or {done: summary}."""
    if isinstance(event, FrameChunk):
        return {"item": event.item, "frame": event.frame, "pixels": to_numpy(event.pixels)}
    return stream_message(event)


def grpc_frame_message(event: StreamEvent):
    """DecodeFrames: a vae_service.v1.FrameMessage (`chunk` or `done`)."""
    return frame_message_proto(stream_message(event))
