"""gRPC answers of a decode replica as plain data (`GrpcAnswer` crosses handles to a routing
ingress), then set on the caller's context: status code, details, and the error's type, field
and Retry-After as trailers (vae_service_client.errors)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from vae_service.protocol.errors import ANSWERABLE, WireErrorInfo, wire_error
from vae_service.protocol.grpc_decode import request_from_proto, response_protos
from vae_service.serving.decode_service import DecodeService
from vae_service_client.grpc_gen import decode_pb2


@dataclass
class GrpcAnswer:
    messages: list = field(default_factory=list)
    error: WireErrorInfo | None = None

    def _fail(self, grpc_context) -> None:
        grpc_context.set_code(grpc.StatusCode[self.error.grpc_code])
        grpc_context.set_details(self.error.message)
        grpc_context.set_trailing_metadata(self.error.grpc_trailers())

    def unary(self, grpc_context):
        if self.error is not None:
            self._fail(grpc_context)
            return decode_pb2.DecodeResponse()
        return self.messages[0]

    def stream(self, grpc_context):
        if self.error is not None:
            self._fail(grpc_context)
            return
        yield from self.messages


def failed(exc: BaseException) -> GrpcAnswer:
    return GrpcAnswer(error=wire_error(exc))


async def grpc_answer(service: DecodeService, request, stream: bool) -> GrpcAnswer:
    try:
        result = await service.decode_from(lambda: request_from_proto(request), request.ByteSize())
    except ANSWERABLE as exc:
        return failed(service.rejected(exc))
    return GrpcAnswer(response_protos(result, stream))
