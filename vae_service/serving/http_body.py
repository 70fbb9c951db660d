"""Reading a request body under the byte budget, before any of it is parsed."""

from __future__ import annotations

from starlette.requests import Request

from vae_service.config import Limits
from vae_service.errors import RequestError
from vae_service.protocol.decode_schema import check_body_size


async def read_body(request: Request, limits: Limits) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError("Content-Length", f"must be an integer, got {declared!r}")
        check_body_size(int(declared), limits)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        check_body_size(size, limits)  # a body longer than declared is cut off early, too
        chunks.append(chunk)
    return b"".join(chunks)
