"""Python client for vae-service (no server imports: only the shared wire format)."""

from vae_service.protocol.decode_schema import UNSET
from vae_service_client.http_client import AsyncVaeClient, VaeClient
from vae_service_client.wire import DecodeResponse, VaeServiceError

__all__ = ["AsyncVaeClient", "DecodeResponse", "UNSET", "VaeClient", "VaeServiceError"]
