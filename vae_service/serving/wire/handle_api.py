"""Serve composition: `decode(latents, quality=..., output=..., **options)` through a handle, and
`decode_frames(...)` through a streaming handle (video frames as they are decoded). The options are
the /decode keys, `priority` among them (the scheduler's class; absent: the deployment's default).
Bad input raises the typed error a client would raise for the same HTTP answer
(vae_service_client.InvalidRequest etc., with `status`, `type` and `field`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from vae_service.protocol.errors import ANSWERABLE, wire_error
from vae_service.protocol.requests import request_from_call
from vae_service.protocol.responses import handle_frame_message, handle_response
from vae_service.serving.decode_service import DecodeService


async def handle_decode(service: DecodeService, latents, resident_device=None, **options) -> dict:
    """`resident_device`: latents already on it are not copied to the host first (request_from_call)."""
    try:
        result = await service.decode(request_from_call(latents, resident_device, **options))
    except ANSWERABLE as exc:
        raise wire_error(service.rejected(exc)).client_error() from None
    return handle_response(result)


async def handle_decode_frames(service: DecodeService, latents, **options) -> AsyncIterator[dict]:
    try:
        request = request_from_call(latents, **{**options, "stream": True})
        stream = await service.submit(lambda: request, request.latents.nbytes)
        async for event in stream.events():
            yield handle_frame_message(event)
    except ANSWERABLE as exc:
        raise wire_error(service.rejected(exc)).client_error() from None
