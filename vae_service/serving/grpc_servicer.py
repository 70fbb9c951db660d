"""gRPC answers of a decode replica as plain data (they cross handles to a routing ingress), then
set on the caller's context: status code, details, and the error's type, field and Retry-After as
trailers (vae_service_client.errors)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from vae_service.engine.result import DecodeResult
from vae_service.protocol.errors import ANSWERABLE, WireErrorInfo, wire_error
from vae_service.protocol.frames import grpc_message
from vae_service.protocol.grpc_decode import request_from_proto, response_protos
from vae_service.serving.decode_service import DecodeService
from vae_service_client.grpc_gen import decode_pb2

STREAMED_OUTPUTS = ("uint8", "float")


def fail(grpc_context, error: WireErrorInfo) -> None:
    grpc_context.set_code(grpc.StatusCode[error.grpc_code])
    grpc_context.set_details(error.message)
    grpc_context.set_trailing_metadata(error.grpc_trailers())


def status_message(grpc_context, error: WireErrorInfo):
    """The last message of a DecodeStream that fails: Serve 2.60's gRPC proxy relays a stream's
    status only along with a message (without one the caller sees OK and an empty stream), so an
    empty message carries it; clients skip it."""
    fail(grpc_context, error)
    return decode_pb2.DecodeResponse()


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
    return GrpcAnswer(response_protos(result, stream=False)[0])


async def grpc_events(service: DecodeService, request) -> AsyncIterator:
    """DecodeStream's messages, or a WireErrorInfo where it fails (the last event). A video model
    with uint8/float output streams each chunk of frames as it is decoded, then a `done` message;
    anything else gets one message per batch item once decoded."""

    def parse():
        decode_request = request_from_proto(request)
        if service.engine.video and decode_request.output in STREAMED_OUTPUTS:
            return replace(decode_request, stream=True)
        return decode_request

    try:
        outcome = await service.submit(parse, request.ByteSize())
        if isinstance(outcome, DecodeResult):
            for message in response_protos(outcome, stream=True):
                yield message
            return
        async for event in outcome.events():
            yield grpc_message(event)
    except ANSWERABLE as exc:
        yield wire_error(service.rejected(exc))


async def stream_to(grpc_context, events: AsyncIterator) -> AsyncIterator:
    """Relay grpc_events to the caller, ending with the error's status where one comes."""
    async for event in events:
        if isinstance(event, WireErrorInfo):
            yield status_message(grpc_context, event)
            return
        yield event
