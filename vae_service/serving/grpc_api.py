"""gRPC answers as plain data (they cross handles to a routing ingress), then status codes and
details set on the caller's context."""

from __future__ import annotations

from dataclasses import dataclass, field

from vae_service.errors import RequestError
from vae_service.protocol.grpc_codec import STATUS
from vae_service.protocol.grpc_gen import decode_pb2


@dataclass
class GrpcResult:
    messages: list[decode_pb2.DecodeResponse] = field(default_factory=list)
    error: str | None = None  # the RequestError type
    message: str = ""

    @classmethod
    def failed(cls, exc: RequestError) -> "GrpcResult":
        return cls([], exc.type, exc.message)

    def _fail(self, grpc_context) -> None:
        grpc_context.set_code(STATUS.get(self.error, STATUS["invalid_request"]))
        grpc_context.set_details(self.message)
        # the precise type, so clients can tell "too large" from "overloaded" (both RESOURCE_EXHAUSTED)
        grpc_context.set_trailing_metadata([("error-type", self.error)])

    def unary(self, grpc_context) -> decode_pb2.DecodeResponse:
        if self.error is not None:
            self._fail(grpc_context)
            return decode_pb2.DecodeResponse()
        return self.messages[0]

    def stream(self, grpc_context):
        if self.error is not None:
            self._fail(grpc_context)
            return
        yield from self.messages
