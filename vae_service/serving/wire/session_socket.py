"""A decode session's conversation (`conversation`: the messages as maps, whatever carries them) and
the WebSocket `/sessions` route of a decode replica that speaks it: one decode session per
connection, on the replica that accepted it (the connection is the affinity: every chunk reaches the
same causal cache); gRPC's DecodeSession speaks it too (grpc_servicer.py). Messages
(docs/interfaces.md, "Decode sessions"): `open`, then `chunk`s, then `close`; the answers
`opened`, each chunk's frame messages (or mp4/webm fragments) then `chunk_done`, `closed`, and
`error` (a bad chunk's leaves the session open and unchanged; an open's or `session_expired` ends
the connection). A disconnect frees the session at once.

Also the handle surface (`SessionCalls`): the same session through Serve handles and the Ray actor,
pinned to its replica by serving/scheduling/session_router.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from vae_service.engine.execution.session import DecodeSession
from vae_service.engine.request.errors import InvalidInput
from vae_service.engine.request.session import SessionExpired, SessionLost, SessionMoved
from vae_service.protocol.errors import ANSWERABLE, BodyTimeout, Unauthenticated, WireErrorInfo, wire_error
from vae_service.protocol.requests import call_latents
from vae_service.protocol.sessions import (
    attached_message,
    chunk_of,
    chunk_request,
    closed_message,
    error_message,
    fragment_message,
    frames_of,
    moved_message,
    opened_message,
    parse_message,
    session_attach,
    session_delivery,
    session_open,
)
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.scheduling.admission import Admission
from vae_service.serving.sessions.keeper import CHECKPOINT, HANDOFF
from vae_service_client.errors import make_error
from vae_service_client.messages import pack

NORMAL, POLICY = 1000, 1008
DENIAL = "websocket.http.response"  # the ASGI extension that answers a handshake with HTTP


@dataclass(frozen=True)
class Reply:
    """One answer of a session's conversation; `ends`: the transport ends the connection after it
    (`refused`: an open that was refused, else a session that ended: closed or expired), `error` the
    error it carries where there is one."""

    message: dict
    ends: bool = False
    refused: bool = False
    error: WireErrorInfo | None = None


Receive = Callable[[], Awaitable[tuple[str, dict] | None]]


class CallerGone(Exception):
    """The caller went away while its chunk decoded: the chunk was stopped."""


class SessionLeft(Exception):
    """The session left this replica (it drains); `kept`: its state waits for the client elsewhere."""

    def __init__(self, kept: bool):
        super().__init__(kept)
        self.kept = kept


class Inbox:
    """The caller's messages, one read at a time, and read while a chunk decodes too: a caller gone
    mid-chunk stops the chunk at its next latent frame (its decode's context abandoned, as a streamed
    /decode's), and a message sent meanwhile waits its turn."""

    def __init__(self, receive: Receive):
        self.receive, self.reading = receive, None

    def _read(self) -> asyncio.Future:
        if self.reading is None:
            self.reading = asyncio.ensure_future(self.receive())
        return self.reading

    async def next(self, timeout_s: float, departure: asyncio.Future | None = None) -> tuple[str, dict] | None:
        """The next message (None: the caller went away); TimeoutError when none came in time;
        SessionLeft when the session's `departure` came first (its replica drains)."""
        reading = self._read()
        waiting = {reading} if departure is None else {reading, departure}
        done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise TimeoutError
        if reading not in done:
            raise SessionLeft(departure.result())
        self.reading = None
        return _received(reading)

    async def during(self, work: Awaitable):
        """`work`'s result, watching the caller meanwhile; CallerGone (the work cancelled) where the
        caller went away before it finished."""
        job, reading = asyncio.ensure_future(work), self._read()
        try:
            done, _ = await asyncio.wait({job, reading}, return_when=asyncio.FIRST_COMPLETED)
            if job not in done and _gone(reading):
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
                raise CallerGone
            return await job
        finally:
            job.cancel()

    def close(self) -> None:
        if self.reading is not None:
            self.reading.cancel()


def _gone(reading: asyncio.Future) -> bool:
    """A read that ended without a message: the transport closed, was cancelled or broke (a message
    that could not be read is not that: it is answered in its turn)."""
    if reading.cancelled():
        return True
    error = reading.exception()
    return (error is None and reading.result() is None) or (error is not None and not isinstance(error, ANSWERABLE))


def _received(reading: asyncio.Future) -> tuple[str, dict] | None:
    """The message read (None: the caller went away); a message that could not be read raises its error."""
    return None if _gone(reading) else reading.result()


async def conversation(service: DecodeService, admit: Callable[[], None], receive: Receive) -> AsyncIterator[Reply]:
    """One decode session, whatever carries it (the WebSocket, gRPC's DecodeSession): `admit`
    raises where the caller may not decode; `receive` is the next message as (kind, map), None when
    the caller went away, raising InvalidInput for a message it cannot read.

    Bounded: the conversation holds one of the replica's session connections (apart from its decode
    slots) from its first moment; it waits `sessions.open_timeout_s` for `open`, and for the next
    message at most the idle timeout (the session then expired) and `open_timeout_s` more to answer
    it `session_expired`, then ends saying so (every message after the expiry is answered so). The
    session is freed when the conversation ends, however it ends (a disconnect, also in the middle of
    a chunk: at once; a caller that already sent its next message is seen gone after the chunk)."""
    sessions, timeouts = service.sessions, service.config.sessions
    inbox, connected, session_id, me = Inbox(receive), False, None, object()
    try:
        try:
            admit()
            sessions.connect()
            connected = True
            try:
                first = await inbox.next(timeouts.open_timeout_s)
            except TimeoutError:
                why = f"no open within {timeouts.open_timeout_s:g} s (sessions.open_timeout_s)"
                raise BodyTimeout("open", why) from None
            if first is None:
                return
            kind, fields = first
            if kind == "open":
                settings = session_open(fields)
                session = sessions.open(settings, session_delivery(fields, settings.output))
                first_answer = opened_message(sessions.describe_session(session))
            elif kind == "attach":
                session, came_from = await attach(service, *session_attach(fields))
                where = {
                    "latent_frames": session.latent_frames,
                    "frames": session.frames,
                    "checkpointed_latent_frames": sessions.checkpointed.get(session.id, 0),
                }
                first_answer = attached_message({**sessions.describe_session(session), **where}, came_from)
            else:
                raise InvalidInput("message", f"the first message of a session is 'open' or 'attach', got {kind!r}")
        except ANSWERABLE as exc:
            info = wire_error(service.rejected(exc))
            yield Reply(error_message(info), ends=True, refused=True, error=info)
            return
        session_id = session.id
        sessions.bind(session_id, me)
        yield Reply(first_answer)
        while True:
            try:
                try:
                    departure = sessions.departure(session_id)
                    received = await inbox.next(sessions.idle_timeout_s + timeouts.open_timeout_s, departure)
                except TimeoutError:  # idle past its timeout: the sweep freed it, or frees it now
                    sessions.session(session_id)  # sweeps; raises SessionExpired naming what it had decoded
                    continue
                except ANSWERABLE:  # a message that could not be read: an expired session's conversation ends
                    sessions.session(session_id)
                    raise
                if received is None:
                    return
                sessions.session(session_id)  # whatever came, an expired session answers session_expired
                kind, fields = received
                if kind == "close":
                    summary = sessions.close(session_id, by_client=True)
                    yield Reply(closed_message(summary, session.settings.output), ends=True)
                    return
                if kind == "open":
                    raise InvalidInput("message", "this connection's session is open already: send chunks, then close")
                request, latent_frame = chunk_request(fields, session.settings)
                answer = await inbox.during(sessions.chunk(session_id, request, latent_frame))
            except CallerGone:
                return
            except SessionMoved:  # a chunk sent while the session leaves: not applied, sent again there
                # the drain's own deadline bounds this wait: it closes a session it cannot hand on
                kept = await sessions.departure(session_id)
                yield departed(service, session_id, kept)
                return
            except SessionLeft as left:
                yield departed(service, session_id, left.kept)
                return
            except SessionExpired as exc:
                info = wire_error(service.rejected(exc))
                yield Reply(
                    error_message(info, frames=exc.frames, latent_frames=exc.latent_frames), ends=True, error=info
                )
                return
            except ANSWERABLE as exc:
                yield Reply(error_message(wire_error(service.rejected(exc)), frames=session.frames))
                continue
            if sessions.frames_back(session_id):
                for message in [fragment_message(f) for f in answer.fragments] or [frames_of(answer.frames)]:
                    yield Reply(message)
            yield Reply({"chunk_done": answer.done(session, sessions.checkpointed.get(session_id, 0))})
    finally:
        inbox.close()
        if session_id is not None:
            sessions.release(session_id, me, "the client disconnected")
        if connected:
            sessions.disconnect()


async def attach(service: DecodeService, session_id: str, received: int | None) -> tuple[DecodeSession, str]:
    """The session of that id, to continue on this connection: open here already (a handle
    continued it here), or taken over from the keeper (a drained replica's handoff, a lost one's
    checkpoint). `received`: the latent frames the client has; a session past them cannot go back."""
    session = service.sessions.open_sessions.get(session_id)
    if session is None:
        if service.session_moves is None:
            raise SessionLost("session", f"no session {session_id!r} here, and no keeper to continue it from")
        return await service.session_moves.take_over(session_id, received)
    if received is not None and session.latent_frames > received:
        raise InvalidInput(
            "latent_frames",
            f"the session has decoded {session.latent_frames} latent frames, more than the {received} received: "
            "open a new session",
        )
    return session, HANDOFF


def departed(service: DecodeService, session_id: str, kept: bool) -> Reply:
    """The last answer of a session that left this replica: `moved` (attach to it again: the
    clients do) or, where its state could not be kept, `session_lost` (resume by replaying)."""
    if kept:
        return Reply(moved_message(session_id), ends=True)
    lost = SessionLost("session", "its replica shut down and its state could not be handed on: resume in a new session")
    info = wire_error(service.rejected(lost))
    return Reply(error_message(info), ends=True, error=info)


async def serve_session(service: DecodeService, admission: Admission, ws: WebSocket) -> None:
    """The WebSocket transport: one binary msgpack message each way per Reply. A handshake without
    the token is refused with 401 before the upgrade where the server can answer a handshake with
    HTTP (the proxy guard refuses it there already); elsewhere the conversation's first answer says
    so and the connection closes."""
    if DENIAL in ws.scope.get("extensions", {}):
        try:
            admission.check(ws.headers.get("authorization"))
        except Unauthenticated as exc:
            error = wire_error(service.rejected(exc))
            await ws.send_denial_response(
                Response(error.http_body(), error.http_status, error.http_headers(), "application/json")
            )
            return
    await ws.accept()
    limit = service.config.limits.max_request_bytes

    async def receive() -> tuple[str, dict] | None:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return None
        body = message.get("bytes")
        if body is None:
            raise InvalidInput("message", "session messages are binary msgpack maps, not text frames")
        return parse_message(body, limit)

    replies = conversation(service, lambda: admission.check(ws.headers.get("authorization")), receive)
    try:
        async for reply in replies:
            await ws.send_bytes(pack(reply.message))
            if reply.ends:
                await ws.close(POLICY if reply.refused else NORMAL)
    except WebSocketDisconnect:
        pass
    finally:
        await replies.aclose()


class SessionCalls:
    """Sessions through Serve handles and the Ray actor: `open_session(**settings)` -> the opened
    summary (its `session` id), `decode_chunk(session, latents, latent_frame=None)` -> the chunk's
    frame message (numpy pixels) or fragments with `chunk_done`, `close_session(session)`. Errors
    raise the client's typed errors (SessionExpired, SessionLost, InvalidRequest, ...)."""

    def __init__(self, service: DecodeService, resident_device=None):
        self.service, self.resident_device = service, resident_device

    async def open(self, **settings) -> dict:
        try:
            opening = session_open(settings)
            session = self.service.sessions.open(opening, session_delivery(settings, opening.output))
        except ANSWERABLE as exc:
            raise _client_error(self.service, exc) from None
        return self.service.sessions.describe_session(session)

    async def chunk(self, session_id: str, latents, latent_frame: int | None = None) -> dict:
        sessions = self.service.sessions
        try:
            session = await self._session(session_id, latent_frame)
            request = chunk_of(call_latents(latents, self.resident_device), session.settings)
            answer = await sessions.chunk(session_id, request, latent_frame)
        except ANSWERABLE as exc:
            raise _client_error(self.service, exc) from None
        out = {"done": answer.done(session, sessions.checkpointed.get(session_id, 0))}
        if not sessions.frames_back(session_id):
            return out
        if answer.fragments:
            out["fragments"] = [fragment_message(f) for f in answer.fragments]
        else:
            out.update(frames_of(answer.frames, wire=False))
        return out

    async def close(self, session_id: str) -> dict | None:
        return self.service.sessions.close(session_id, by_client=True)

    async def _session(self, session_id: str, latent_frame: int | None) -> DecodeSession:
        """The session held here, or taken over from the keeper where its replica drained (as it
        was: the call goes on) or was lost (from its checkpoint: unless this chunk starts there, the
        caller is told where to resend from)."""
        try:
            return self.service.sessions.session(session_id)
        except SessionLost:
            if self.service.session_moves is None:
                raise
        session, came_from = await self.service.session_moves.take_over(session_id)
        if came_from == CHECKPOINT and latent_frame != session.latent_frames:
            raise InvalidInput(
                "latent_frame",
                f"its replica was lost; it goes on from its checkpoint at latent frame {session.latent_frames} "
                f"({session.frames} frames): send its chunks again from latent_frame={session.latent_frames}",
            )
        return session


def _client_error(service: DecodeService, exc: BaseException):
    info = wire_error(service.rejected(exc))
    return make_error(info.type, info.field, info.message, info.retry_after_s)
