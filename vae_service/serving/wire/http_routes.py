"""HTTP answers of a decode replica as plain data (`HttpAnswer` crosses handles, so a routing
ingress can forward raw bodies and return the decoder's answer), and the FastAPI glue."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from vae_service.engine.request.result import DecodeResult
from vae_service.protocol.errors import ANSWERABLE, Unauthenticated, internal_error, wire_error
from vae_service.protocol.hf_remote import parse_remote_decode, remote_decode_reply
from vae_service.protocol.requests import parse_decode_body
from vae_service.protocol.responses import (
    CONTENT_TYPE,
    http_error_message,
    http_frame_message,
    msgpack_response,
    video_error_bytes,
    video_stream_bytes,
)
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.outputs.frame_stream import FrameStream
from vae_service.serving.outputs.video_stream import VideoStream
from vae_service.serving.scheduling.admission import Admission
from vae_service_client.frames import STREAM_MEDIA_TYPE

STREAM_HEADER = "x-vae-stream"  # on a streamed answer: what it streams ("frames", "mp4" or "webm")


@dataclass
class HttpAnswer:
    status: int
    body: bytes
    media_type: str
    headers: dict = field(default_factory=dict)

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.media_type, headers=self.headers)


def error_answer(exc: BaseException) -> HttpAnswer:
    info = wire_error(exc)
    return HttpAnswer(info.http_status, info.http_body(), "application/json", info.http_headers())


async def decode_answer(service: DecodeService, body: bytes, content_type: str | None) -> HttpAnswer:
    max_bytes = service.config.limits.max_request_bytes
    try:
        result = await service.decode_from(lambda: parse_decode_body(body, content_type, max_bytes), len(body))
    except ANSWERABLE as exc:
        return error_answer(service.rejected(exc))
    return HttpAnswer(200, msgpack_response(result), CONTENT_TYPE)


async def decode_events(service: DecodeService, body: bytes, content_type: str | None) -> AsyncIterator:
    """The answer to a /decode body: one HttpAnswer; for `stream: true`, an HttpAnswer that opens
    the stream (200, its media type, no body) and then the stream's bytes: message by message, or
    a video stream's fragments. Plain data, so a routing ingress can relay it from a streaming handle."""
    max_bytes = service.config.limits.max_request_bytes
    try:
        outcome = await service.submit(lambda: parse_decode_body(body, content_type, max_bytes), len(body))
    except ANSWERABLE as exc:
        yield error_answer(service.rejected(exc))
        return
    if isinstance(outcome, DecodeResult):
        yield HttpAnswer(200, msgpack_response(outcome), CONTENT_TYPE)
        return
    if isinstance(outcome, VideoStream):
        output = outcome.output
        yield HttpAnswer(200, b"", outcome.media_type, {STREAM_HEADER: output})
        encode, encode_error = partial(video_stream_bytes, output=output), partial(video_error_bytes, output=output)
        async for data in _stream_bytes(service, outcome, encode, encode_error):
            yield data
        return
    yield HttpAnswer(200, b"", STREAM_MEDIA_TYPE, {STREAM_HEADER: "frames"})
    async for data in _stream_bytes(service, outcome, http_frame_message, http_error_message):
        yield data


async def _stream_bytes(
    service: DecodeService, stream: FrameStream | VideoStream, encode: Callable, encode_error: Callable
) -> AsyncIterator[bytes]:
    try:
        async for event in stream.events():
            yield encode(event)
    except ANSWERABLE as exc:  # after frames went out: the stream's last message says why
        yield encode_error(wire_error(service.rejected(exc)))
    except Exception as exc:
        yield encode_error(internal_error(exc, "an HTTP frame stream"))


async def respond(events: AsyncIterator) -> Response:
    """decode_events -> a FastAPI response (streaming when the first event opens a stream)."""
    first = await anext(events)
    if STREAM_HEADER not in first.headers:
        await events.aclose()
        return first.response()

    async def rest() -> AsyncIterator[bytes]:
        try:
            async for data in events:
                yield data
        finally:  # a client that went away: cancel its request
            await events.aclose()

    return StreamingResponse(rest(), media_type=first.media_type, headers=first.headers)


async def remote_decode_answer(
    service: DecodeService, body: bytes, content_type: str | None, accept: str | None, query: dict[str, list[str]]
) -> HttpAnswer:
    try:
        plan = parse_remote_decode(body, content_type, accept, query)
        result = await service.decode(plan.request)
    except ANSWERABLE as exc:
        return error_answer(service.rejected(exc))
    data, media_type, headers = remote_decode_reply(plan, result)
    return HttpAnswer(200, data, media_type, headers)


async def _authenticated_body(service: DecodeService, admission: Admission, request: Request) -> bytes:
    """The token, then the body under the replica's current limits (live: Serve's user_config)."""
    return await admission.with_limits(service.config.limits).admit(request)


async def decode_http(service: DecodeService, admission: Admission, request: Request) -> Response:
    try:
        body = await _authenticated_body(service, admission, request)
    except ANSWERABLE as exc:
        return error_answer(service.rejected(exc)).response()
    return await respond(decode_events(service, body, request.headers.get("content-type")))


async def remote_decode_http(service: DecodeService, admission: Admission, request: Request) -> HttpAnswer:
    try:
        body = await _authenticated_body(service, admission, request)
    except ANSWERABLE as exc:
        return error_answer(service.rejected(exc))
    headers = request.headers
    return await remote_decode_answer(
        service, body, headers.get("content-type"), headers.get("accept"), query_lists(request)
    )


def health_fields(auth: Admission, details: dict) -> dict:
    """/health: details, behind the same token as the decode routes (Serve's own /-/healthz is the
    cheap liveness probe, answered by its proxy and never queued behind decodes)."""
    return {"status": "ok", "auth": "bearer" if auth.required else "none", **details}


def query_lists(request: Request) -> dict[str, list[str]]:
    """Starlette QueryParams -> plain data that crosses a handle."""
    out: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        out.setdefault(key, []).append(value)
    return out


def api_docs(service: DecodeService, admission: Admission, request: Request, app: FastAPI, page: str) -> Response:
    """FastAPI's API documentation (`page`: "openapi", "swagger" or "redoc"), behind the same token
    as the decode routes: the schema lists every route and limit of the service."""
    try:
        admission.check(request.headers.get("authorization"))
    except Unauthenticated as exc:
        return error_answer(service.rejected(exc)).response()
    if page == "openapi":
        return JSONResponse(app.openapi())
    schema = request.scope.get("root_path", "").rstrip("/") + "/openapi.json"  # under the route prefix
    if page == "redoc":
        return get_redoc_html(openapi_url=schema, title=f"{app.title} - ReDoc")
    return get_swagger_ui_html(openapi_url=schema, title=f"{app.title} - Swagger UI")
