"""Serve composition: `decode(latents, quality=..., output=..., **options)` through a handle, and
`decode_frames(...)` through a streaming handle (video frames as they are decoded).
Bad input raises the typed error a client would raise for the same HTTP answer
(vae_service_client.InvalidRequest etc., with `status`, `type` and `field`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from vae_service.engine.video import FrameChunk
from vae_service.protocol.errors import ANSWERABLE, wire_error
from vae_service.protocol.handle_call import request_from_call, result_to_call
from vae_service.protocol.msgpack_decode import response_of
from vae_service.protocol.tensors import to_numpy
from vae_service.serving.decode_service import DecodeService


async def handle_decode(service: DecodeService, latents, resident_device=None, **options) -> dict:
    """`resident_device`: latents already on it are not copied to the host first (request_from_call)."""
    try:
        result = await service.decode(request_from_call(latents, resident_device, **options))
    except ANSWERABLE as exc:
        raise wire_error(service.rejected(exc)).client_error() from None
    return result_to_call(result)


async def handle_decode_frames(service: DecodeService, latents, **options) -> AsyncIterator[dict]:
    try:
        request = request_from_call(latents, **{**options, "stream": True})
        stream = await service.submit(lambda: request, request.latents.nbytes)
        async for event in stream.events():
            if isinstance(event, FrameChunk):
                yield {"item": event.item, "frame": event.frame, "pixels": to_numpy(event.pixels)}
            else:
                yield {"done": response_of(event).summary()}
    except ANSWERABLE as exc:
        raise wire_error(service.rejected(exc)).client_error() from None
