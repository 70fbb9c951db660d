"""Python clients for vae-service (no server imports: only the shared wire formats)."""

from vae_service.protocol.decode_schema import UNSET
from vae_service_client.grpc_client import AsyncVaeGrpcClient, VaeGrpcClient
from vae_service_client.http_client import AsyncVaeClient, VaeClient
from vae_service_client.wire import (
    DecodeResponse,
    DecodeTimeout,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    ServerError,
    VaeServiceError,
)

__all__ = ["AsyncVaeClient", "AsyncVaeGrpcClient", "DecodeResponse", "DecodeTimeout", "InvalidRequest", "Overloaded",
           "PayloadTooLarge", "ServerError", "UNSET", "VaeClient", "VaeGrpcClient", "VaeServiceError"]
