"""The WebSocket `/sessions` route of a decode replica: one decode session per connection, on the
replica that accepted it (the connection is the affinity: every chunk reaches the same causal
cache). Messages (docs/interfaces.md, "Decode sessions"): `open`, then `chunk`s, then `close`; the
answers `opened`, each chunk's frame messages (or mp4/webm fragments) then `chunk_done`, `closed`,
and `error` (a bad chunk's leaves the session open and unchanged; an open's or `session_expired`
ends the connection). A disconnect frees the session at once.

Also the handle surface (`SessionCalls`): the same session through Serve handles and the Ray actor,
pinned to its replica by serving/session_router.py.
"""

from __future__ import annotations

from starlette.websockets import WebSocket, WebSocketDisconnect

from vae_service.engine.request.errors import InvalidInput
from vae_service.engine.request.session import SessionExpired
from vae_service.protocol.errors import ANSWERABLE, wire_error
from vae_service.protocol.requests import call_latents
from vae_service.protocol.sessions import (
    chunk_of,
    chunk_request,
    closed_message,
    error_message,
    fragment_message,
    frames_of,
    opened_message,
    parse_message,
    session_open,
)
from vae_service.serving.admission import Admission
from vae_service.serving.decode_service import DecodeService
from vae_service_client.errors import make_error
from vae_service_client.messages import pack

NORMAL, POLICY, GOING_AWAY = 1000, 1008, 1001


async def serve_session(service: DecodeService, admission: Admission, ws: WebSocket) -> None:
    await ws.accept()
    session_id = None
    try:
        try:
            admission.check(ws.headers.get("authorization"))
            kind, fields = parse_message(await ws.receive_bytes(), service.config.limits.max_request_bytes)
            if kind != "open":
                raise InvalidInput("message", f"the first message of a session is 'open', got {kind!r}")
            session = service.sessions.open(session_open(fields))
        except ANSWERABLE as exc:
            await _send(ws, error_message(wire_error(service.rejected(exc))))
            await ws.close(POLICY)
            return
        session_id = session.id
        await _send(ws, opened_message(service.sessions.describe_session(session)))
        while True:
            body = await ws.receive_bytes()
            try:
                kind, fields = parse_message(body, service.config.limits.max_request_bytes)
                if kind == "close":
                    summary = service.sessions.close(session_id)
                    await _send(ws, closed_message(summary, session.settings.output))
                    await ws.close(NORMAL)
                    return
                if kind == "open":
                    raise InvalidInput("message", "this connection's session is open already: send chunks, then close")
                request, latent_frame = chunk_request(fields, session.settings)
                answer = await service.sessions.chunk(session_id, request, latent_frame)
            except SessionExpired as exc:
                info = wire_error(service.rejected(exc))
                await _send(ws, error_message(info, frames=exc.frames, latent_frames=exc.latent_frames))
                await ws.close(NORMAL)
                return
            except ANSWERABLE as exc:
                await _send(ws, error_message(wire_error(service.rejected(exc)), frames=session.frames))
                continue
            if answer.fragments:
                for fragment in answer.fragments:
                    await _send(ws, fragment_message(fragment))
            else:
                await _send(ws, frames_of(answer.frames))
            await _send(ws, {"chunk_done": answer.done(session)})
    except WebSocketDisconnect:
        pass
    finally:
        if session_id is not None:
            service.sessions.close(session_id, "the client disconnected")


async def _send(ws: WebSocket, message: dict) -> None:
    await ws.send_bytes(pack(message))


class SessionCalls:
    """Sessions through Serve handles and the Ray actor: `open_session(**settings)` -> the opened
    summary (its `session` id), `decode_chunk(session, latents, latent_frame=None)` -> the chunk's
    frame message (numpy pixels) or fragments with `chunk_done`, `close_session(session)`. Errors
    raise the client's typed errors (SessionExpired, SessionLost, InvalidRequest, ...)."""

    def __init__(self, service: DecodeService, resident_device=None):
        self.service, self.resident_device = service, resident_device

    async def open(self, **settings) -> dict:
        try:
            session = self.service.sessions.open(session_open(settings))
        except ANSWERABLE as exc:
            raise _client_error(self.service, exc) from None
        return self.service.sessions.describe_session(session)

    async def chunk(self, session_id: str, latents, latent_frame: int | None = None) -> dict:
        sessions = self.service.sessions
        try:
            session = sessions.session(session_id)
            request = chunk_of(call_latents(latents, self.resident_device), session.settings)
            answer = await sessions.chunk(session_id, request, latent_frame)
        except ANSWERABLE as exc:
            raise _client_error(self.service, exc) from None
        out = {"done": answer.done(session)}
        if answer.fragments:
            out["fragments"] = [fragment_message(f) for f in answer.fragments]
        else:
            out.update(frames_of(answer.frames, wire=False))
        return out

    async def close(self, session_id: str) -> dict | None:
        return self.service.sessions.close(session_id)


def _client_error(service: DecodeService, exc: BaseException):
    info = wire_error(service.rejected(exc))
    return make_error(info.type, info.field, info.message, info.retry_after_s)
