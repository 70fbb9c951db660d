"""Serve composition: `decode(latents, quality=..., output=..., **options)` through a handle.
Bad input raises the typed error a client would raise for the same HTTP answer
(vae_service_client.InvalidRequest etc., with `status`, `type` and `field`)."""

from __future__ import annotations

from vae_service.protocol.errors import ANSWERABLE, wire_error
from vae_service.protocol.handle_call import request_from_call, result_to_call
from vae_service.serving.decode_service import DecodeService


async def handle_decode(service: DecodeService, latents, **options) -> dict:
    try:
        result = await service.decode(request_from_call(latents, **options))
    except ANSWERABLE as exc:
        raise wire_error(service.rejected(exc)).client_error() from None
    return result_to_call(result)
