"""HTTP answers as plain data, so that a replica can build them for its own FastAPI routes and
for a routing ingress that forwards raw request bodies through a handle."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi.responses import Response

from vae_service.errors import Overloaded, RequestError

MSGPACK = "application/msgpack"


@dataclass
class HttpReply:
    status: int
    body: bytes
    media_type: str
    headers: dict = field(default_factory=dict)

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.media_type, headers=self.headers)


def error_reply(exc: RequestError) -> HttpReply:
    headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if isinstance(exc, Overloaded) else {}
    return HttpReply(exc.status, json.dumps(exc.to_json()).encode(), "application/json", headers)


def query_dict(query_params) -> dict[str, list[str]]:
    """Starlette QueryParams -> plain data that crosses a handle."""
    out: dict[str, list[str]] = {}
    for key, value in query_params.multi_items():
        out.setdefault(key, []).append(value)
    return out
