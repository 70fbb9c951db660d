"""gRPC answers from `grpc_responses` results: status codes and details set on the context."""

from __future__ import annotations

from vae_service.protocol.grpc_codec import STATUS
from vae_service.protocol.grpc_gen import decode_pb2


def _fail(grpc_context, error: str, message: str) -> None:
    grpc_context.set_code(STATUS.get(error, STATUS["invalid_request"]))
    grpc_context.set_details(message)
    # the precise type, so clients can tell "too large" from "overloaded" (both RESOURCE_EXHAUSTED)
    grpc_context.set_trailing_metadata([("error-type", error)])


def grpc_unary(result: tuple[list[bytes], str | None, str | None], grpc_context) -> decode_pb2.DecodeResponse:
    messages, error, message = result
    if error is not None:
        _fail(grpc_context, error, message)
        return decode_pb2.DecodeResponse()
    return decode_pb2.DecodeResponse.FromString(messages[0])


def grpc_stream(result: tuple[list[bytes], str | None, str | None], grpc_context):
    messages, error, message = result
    if error is not None:
        _fail(grpc_context, error, message)
        return
    for m in messages:
        yield decode_pb2.DecodeResponse.FromString(m)
