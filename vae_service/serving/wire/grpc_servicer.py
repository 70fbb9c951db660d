"""gRPC answers of a decode replica as plain data (they cross handles to a routing ingress), then
set on the caller's context: status code, details, and the error's type, field and Retry-After as
trailers (vae_service_client.errors).

Two server-streaming RPCs, one meaning each, whatever the model: DecodeStream answers one
DecodeResponse per batch item once the batch is decoded; DecodeFrames (video models, uint8/float
output) one FrameMessage per chunk of frames as it is decoded, then `done`. DecodeSession is
bidirectional (Serve 2.60's proxy relays a client's stream to the replica that took the call, message
by message): the stream is one decode session, the WebSocket's conversation in protobuf."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from vae_service.engine.request.errors import InvalidInput
from vae_service.protocol.errors import ANSWERABLE, WireErrorInfo, internal_error, wire_error
from vae_service.protocol.requests import request_from_proto
from vae_service.protocol.responses import grpc_frame_message, grpc_item_responses, grpc_response
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.wire.session_socket import conversation
from vae_service_client.grpc_gen import decode_pb2
from vae_service_client.session_proto import reply_proto, request_map

# the empty message that ends a failed stream, per streaming RPC (status_message)
EMPTY = {
    "DecodeStream": decode_pb2.DecodeResponse,
    "DecodeFrames": decode_pb2.FrameMessage,
    "DecodeSession": decode_pb2.SessionReply,
}


def fail(grpc_context, error: WireErrorInfo) -> None:
    grpc_context.set_code(grpc.StatusCode[error.grpc_code])
    grpc_context.set_details(error.message)
    grpc_context.set_trailing_metadata(error.grpc_trailers())


def status_message(grpc_context, error: WireErrorInfo, rpc: str):
    """The last message of a streaming `rpc` that fails: Serve 2.60's gRPC proxy relays a stream's
    status only along with a message (without one the caller sees OK and an empty stream), so an
    empty message (no field set) carries it; clients skip it."""
    fail(grpc_context, error)
    return EMPTY[rpc]()


@dataclass
class GrpcAnswer:
    message: object = None
    error: WireErrorInfo | None = None

    def unary(self, grpc_context):
        if self.error is not None:
            fail(grpc_context, self.error)
            return decode_pb2.DecodeResponse()
        return self.message


def failed(exc: BaseException) -> GrpcAnswer:
    return GrpcAnswer(error=wire_error(exc))


async def grpc_answer(service: DecodeService, request) -> GrpcAnswer:
    try:
        result = await service.decode_from(lambda: request_from_proto(request), request.ByteSize())
    except ANSWERABLE as exc:
        return failed(service.rejected(exc))
    return GrpcAnswer(grpc_response(result))


async def item_events(service: DecodeService, request) -> AsyncIterator:
    """DecodeStream's messages: one DecodeResponse per batch item, in order, once the batch is
    decoded; or a WireErrorInfo where it fails (the only event)."""
    try:
        result = await service.decode_from(lambda: request_from_proto(request), request.ByteSize())
    except ANSWERABLE as exc:
        yield wire_error(service.rejected(exc))
        return
    for message in grpc_item_responses(result):
        yield message


async def frame_events(service: DecodeService, request) -> AsyncIterator:
    """DecodeFrames' messages: a FrameMessage per chunk of frames as it is decoded, then `done`; or
    a WireErrorInfo where it fails (the last event; before any frame: the only one)."""
    try:
        stream = await service.submit(lambda: request_from_proto(request, stream=True), request.ByteSize())
        async for event in stream.events():
            yield grpc_frame_message(event)
    except ANSWERABLE as exc:
        yield wire_error(service.rejected(exc))
    except Exception as exc:  # after frames went out: the status says what happened, not a reset
        yield internal_error(exc, "a DecodeFrames stream")


async def stream_to(grpc_context, events: AsyncIterator, rpc: str) -> AsyncIterator:
    """Relay item_events or frame_events to the caller, ending with the error's status where one comes."""
    async for event in events:
        if isinstance(event, WireErrorInfo):
            yield status_message(grpc_context, event, rpc)
            return
        yield event


async def session_replies(service: DecodeService, admit, requests, grpc_context) -> AsyncIterator:
    """DecodeSession: the session's conversation (session_socket.py) over the caller's stream of
    SessionRequests. An error that ends the session (an open refused, session_expired) is its last
    reply and the stream's status; a chunk's error is a reply and the session goes on."""
    requests = aiter(requests)

    async def receive() -> tuple[str, dict] | None:
        try:
            request = await anext(requests)
        except StopAsyncIteration:  # the caller half-closed or went away
            return None
        kind, fields = request_map(request)
        if kind is None:
            raise InvalidInput("message", "an empty SessionRequest: set open, chunk or close")
        return kind, fields

    replies = conversation(service, admit, receive)
    try:
        async for reply in replies:
            if reply.error is not None:
                fail(grpc_context, reply.error)
            yield reply_proto(reply.message)
    finally:
        await replies.aclose()
