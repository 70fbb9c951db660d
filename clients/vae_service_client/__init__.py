"""Python clients for vae-service: HTTP (and decode sessions over its WebSocket) and gRPC, sync
and async, and the wire codec they share with the server. Depends on numpy, msgpack, httpx,
websockets, grpcio and protobuf only; torch tensors are accepted when torch is installed. The gRPC
clients load grpc on first use."""

from vae_service_client.errors import (
    DecodeTimeout,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    ServerError,
    ServiceUnreachable,
    SessionExpired,
    SessionLost,
    SessionMoved,
    StoreRefused,
    Unauthenticated,
    Unavailable,
    VaeServiceError,
)
from vae_service_client.http_client import AsyncVaeClient, VaeClient
from vae_service_client.messages import UNSET, DecodeResponse
from vae_service_client.sessions import AsyncDecodeSession, DecodeSession, SessionChunk, Watch

_GRPC = ("AsyncVaeGrpcClient", "VaeGrpcClient")


def __getattr__(name: str):
    if name in _GRPC:
        from vae_service_client import grpc_client

        return getattr(grpc_client, name)
    raise AttributeError(f"module 'vae_service_client' has no attribute {name!r}")


__all__ = [
    "UNSET",
    "AsyncDecodeSession",
    "AsyncVaeClient",
    "AsyncVaeGrpcClient",
    "DecodeResponse",
    "DecodeSession",
    "DecodeTimeout",
    "InvalidRequest",
    "Overloaded",
    "PayloadTooLarge",
    "ServerError",
    "ServiceUnreachable",
    "SessionChunk",
    "SessionExpired",
    "SessionLost",
    "SessionMoved",
    "StoreRefused",
    "Unauthenticated",
    "Unavailable",
    "VaeClient",
    "VaeGrpcClient",
    "VaeServiceError",
    "Watch",
]
