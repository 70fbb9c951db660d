"""Viewers' routes of a decode replica (docs/interfaces.md, "Watching a session"):

- `GET /watch/<id>`: the watch page, the same bytes for every id (it says nothing of a session);
- `WS /watch/<id>/stream`: the session's mp4/webm from the viewer's join point, for MediaSource;
- `POST /watch/<id>/whep`, `DELETE /watch/<id>/whep/<resource>`: WebRTC by WHEP (RFC 9725).

The media routes take the session's watch token (or the service's) as `Authorization: Bearer`; a
browser's WebSocket cannot set that header, so `/stream` also takes it as its first message. A
refusal is the same for a wrong token, none, and a session not watched here (serving/viewers/hub.py).
Viewers live on the replica that holds the session: its frames are there, and a viewer costs the
session nothing but a queue (serving/viewers/feed.py).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from vae_service.engine.request.errors import InvalidInput, LimitExceeded, Overloaded, Unavailable
from vae_service.protocol.errors import ANSWERABLE, Unauthenticated, UnsupportedMediaType
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.scheduling.admission import bearer_token
from vae_service.serving.viewers.feed import STREAM, WEBRTC, FramePacer, SessionFeed, Viewer
from vae_service.serving.viewers.hub import REFUSED
from vae_service.serving.viewers.relay import RelayedViewer, RemoteStream
from vae_service.serving.viewers.sdp_offer import MAX_OFFER_BYTES, read_offer
from vae_service.serving.viewers.watch_page import PAGE, PAGE_HEADERS
from vae_service.serving.wire.http_routes import error_answer

log = logging.getLogger("ray.serve")
# WebSocket close codes: HTTP's status in the 4000-4999 private range
UNAUTHORIZED, TOO_MANY, UNAVAILABLE = 4401, 4429, 4503
MAX_TOKEN_MESSAGE = 1024
DENIAL = "websocket.http.response"


def watch_page() -> Response:
    return Response(PAGE, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


class WatchRoutes:
    """A replica's viewers' routes over its DecodeService (its sessions' ViewerHub) and Admission
    (the service's own token also watches)."""

    def __init__(self, service: DecodeService, admission, replica: Callable[[], str] = lambda: "local"):
        """`replica`: this replica's id (a WHEP resource names the replica holding its peer)."""
        self.service, self.admission, self.replica = service, admission, replica
        # the WHEP peers' loop and thread: made on the first WHEP viewer, or now where ICE servers are set, so
        # that one aiortc cannot use fails the replica's start, not every viewer
        self._peers = None
        if service.config.watch.webrtc and service.config.watch.ice_servers:
            self.peers()
        self._tokens: dict[str, str] = {}  # WHEP resource -> the token that made it (DELETE takes the same)
        self._relayed: set[RelayedViewer] = set()
        service.sessions.viewers.service_token = self._is_service_token
        # set in a Serve replica: the stream of a session held by another replica (serving/viewers/relay.py),
        # and a WHEP resource's DELETE sent to the replica holding its peer
        self.remote: RemoteStream | None = None
        self.remote_delete: Callable[[str, str | None], Awaitable[bool]] | None = None

    @property
    def hub(self):
        return self.service.sessions.viewers

    def _is_service_token(self, token: str) -> bool:
        if not self.admission.required:  # no service token: only a session's own token watches it
            return False
        try:
            self.admission.check(f"Bearer {token}")
        except Unauthenticated:
            return False
        return True

    def _error(self, exc: BaseException, request: Request | None = None) -> Response:
        answer = error_answer(self.service.rejected(exc))
        answer.headers |= self._cors(request)
        return answer.response()

    async def _join(self, watch_id: str, token: str | None, kind: str) -> tuple[SessionFeed, Viewer, Callable]:
        """A new viewer of the session: here, or relayed from the replica that holds it; its
        `leave` to call when it goes. Raises Unauthenticated or Overloaded (naming `viewers`)."""
        hub = self.hub
        if hub.knows(watch_id) or self.remote is None:
            feed = hub.authorize(watch_id, token)
            viewer = hub.join(feed, kind)
            return feed, viewer, lambda: hub.leave(feed, viewer)
        relayed = RelayedViewer(watch_id, kind, self.service.config.watch.viewer_queue_fragments, hub.count_drops)
        try:
            # the token is checked where the session is; this replica's room after (a refusal names the token first)
            await relayed.start(self.remote, token, self.service.config.sessions.open_timeout_s)
            hub.check_room()
        except ANSWERABLE:
            hub.refused += 1
            relayed.stop()
            raise
        except Exception as exc:  # the session's replica is unreachable: gone, or between two states
            relayed.stop()
            log.warning("relaying a viewer of watch %s failed: %s", watch_id, exc)
            why = "the replica holding the session did not answer: retry"
            raise Unavailable("session", why, self._retry_after()) from None
        hub.relayed += 1
        self._relayed.add(relayed)

        def leave() -> None:
            relayed.stop()
            if relayed in self._relayed:
                self._relayed.discard(relayed)
                hub.relayed -= 1

        return relayed.feed, relayed.viewer, leave

    # ---- MediaSource over WebSocket --------------------------------------------------------
    async def stream(self, ws: WebSocket, watch_id: str) -> None:
        """Refusals: before the upgrade with HTTP (401, 429) where the token came in the header and
        the server can answer a handshake so, else by closing (4401 `unauthorized`, 4429 `viewers`)."""
        token = bearer_token(ws.headers.get("authorization"))
        refuse_with_http = token is not None and DENIAL in ws.scope.get("extensions", {})
        sessions, connected, leave = self.service.sessions, False, None
        try:
            # a viewer's connection is one of Serve's ongoing requests from its first moment, as a session's
            # is: held within the session connections (kept below the decode slots), waiting for its token too
            sessions.connect()
            connected = True
            if not refuse_with_http:
                await ws.accept()
            if token is None:
                token = await self._first_message_token(ws)
            feed, viewer, leave = await self._join(watch_id, token, STREAM)
            if refuse_with_http:
                await ws.accept()
                refuse_with_http = False
            await ws.send_text(json.dumps({"type": "joined", "frame": feed.frames}))
            await self._send_stream(ws, feed, viewer)
        except (Unauthenticated, InvalidInput, TimeoutError) as exc:
            await self._refuse(ws, refuse_with_http, Unauthenticated("token", REFUSED) if token is None else exc)
        except Unavailable as exc:
            await self._refuse(ws, refuse_with_http, exc)
        except (Overloaded, LimitExceeded) as exc:
            await self._refuse(ws, refuse_with_http, self._as_viewers(exc))
        except WebSocketDisconnect:
            pass
        finally:
            if leave is not None:
                leave()
            if connected:
                sessions.disconnect()

    def _as_viewers(self, exc: Overloaded | LimitExceeded) -> Overloaded:
        """A MediaSource viewer refused for want of room: its own limits, or no session connection free."""
        if exc.field == "viewers":
            return exc
        why = f"no session connection is free for a MediaSource viewer ({exc.message})"
        return Overloaded("viewers", why, self._retry_after())

    async def _refuse(self, ws: WebSocket, with_http: bool, exc: BaseException) -> None:
        if with_http:
            await ws.send_denial_response(self._error(exc))
            return
        if ws.application_state == WebSocketState.CONNECTING:  # refused before the upgrade: said after it
            await ws.accept()
        if isinstance(exc, Unavailable):
            await _close(ws, UNAVAILABLE, "unavailable")
        elif isinstance(exc, Overloaded):
            await _close(ws, TOO_MANY, "viewers")
        else:
            await _close(ws, UNAUTHORIZED, "unauthorized")

    def _retry_after(self) -> float:
        return self.service.config.serving.retry_after_s

    async def _first_message_token(self, ws: WebSocket) -> str | None:
        message = await asyncio.wait_for(ws.receive(), self.service.config.watch.token_wait_s)
        text = message.get("text")
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect()
        if text is None or len(text) > MAX_TOKEN_MESSAGE:
            raise InvalidInput("token", 'the first message is the text {"token": "..."}')
        try:
            token = json.loads(text).get("token")
        except (ValueError, AttributeError):
            raise InvalidInput("token", 'the first message is the text {"token": "..."}') from None
        return token if isinstance(token, str) else None

    async def _send_stream(self, ws: WebSocket, feed: SessionFeed, viewer: Viewer) -> None:
        """Start (once the file's init segment is known), then each fragment as a text line saying
        what it holds and its bytes, then `ended`; never more than the viewer's window of fragments
        it has not acknowledged (Acks), and the viewer's leaving watched throughout."""
        acks = Acks(self.service.config.watch.viewer_queue_fragments)
        reading = asyncio.ensure_future(acks.read(ws))
        started = False
        try:
            while True:
                fetching = asyncio.ensure_future(_next_with_room(viewer, acks))
                done, _ = await asyncio.wait({fetching, reading}, return_when=asyncio.FIRST_COMPLETED)
                if reading in done:
                    fetching.cancel()
                    return
                fragment = fetching.result()
                if fragment is None:
                    ended = {"type": "ended", "reason": viewer.ended, "frames": feed.frames, "dropped": viewer.dropped}
                    await ws.send_text(json.dumps(ended))
                    await _close(ws, 1000, viewer.ended or "ended")
                    return
                if not started:
                    start = {"type": "start", "content_type": feed.content_type, "frame": fragment.frame}
                    await ws.send_text(json.dumps(start))
                    await ws.send_bytes(feed.init)
                    started = True
                line = {
                    "type": "fragment",
                    "frame": fragment.frame,
                    "frames": fragment.frames,
                    "chunk_ms": round(fragment.chunk_ms, 3),
                    "dropped": viewer.dropped,
                }
                acks.sent(fragment.frame)
                await ws.send_text(json.dumps(line))
                await ws.send_bytes(fragment.data)
        finally:
            reading.cancel()

    # ---- WebRTC by WHEP --------------------------------------------------------------------
    async def whep_offer(self, request: Request, watch_id: str) -> Response:
        watch = self.service.config.watch
        if not watch.webrtc:
            return Response(status_code=404, headers=self._cors(request))
        token = bearer_token(request.headers.get("authorization"))
        leave = None
        try:
            if token is None:
                raise Unauthenticated("token", REFUSED)
            body = await self._offer_body(request)
            _, viewer, leave = await self._join(watch_id, token, WEBRTC)  # whoever holds no token learns nothing more
            offer = _offer(body, request.headers.get("content-type"))
            pacer = FramePacer(viewer, self.service.config.encoding.mp4_fps)
            made: list[str] = []  # the resource, once named: forgotten with its peer however it ends

            def ended() -> None:
                leave()
                for name in made:
                    self._tokens.pop(name, None)

            resource, answer = await self.peers().answer(offer, pacer.next_frame, ended)
        except ANSWERABLE as exc:
            if leave is not None:
                leave()
            return self._error(exc, request)
        except BaseException:
            if leave is not None:
                leave()
            raise
        resource = f"{self.replica()}.{resource}"
        self._tokens[resource] = token
        made.append(resource)
        location = f"whep/{resource}"  # relative (RFC 3986): the same under any route prefix
        headers = {"Location": location, **self._cors(request)}
        return Response(answer, 201, headers, "application/sdp")

    async def _offer_body(self, request: Request) -> bytes:
        """The offer's bytes, read as any body (its deadline; on a viewer's route, at most an offer's
        bound without the service token: scheduling/admission.py), too long named `sdp`."""
        try:
            return await self.admission.admit(request, authenticate=False)
        except LimitExceeded as exc:
            raise LimitExceeded("sdp", f"an SDP offer is at most {MAX_OFFER_BYTES} bytes ({exc.message})") from None

    async def whep_delete(self, request: Request, watch_id: str, resource: str) -> Response:
        """200 once the viewer's peer is closed; 404 where there is none (any more); a token other
        than the one that made it: 401."""
        token = bearer_token(request.headers.get("authorization"))
        if not self.service.config.watch.webrtc:
            return Response(status_code=404, headers=self._cors(request))
        if resource.split(".", 1)[0] != self.replica() and self.remote_delete is not None:
            try:
                closed = await self.remote_delete(resource, token)
            except Exception as exc:  # the replica holding the peer is gone (and the peer with it) or unreachable
                log.warning("a WHEP DELETE for another replica failed: %s", exc)
                why = "the replica holding this viewer did not answer: retry"
                return self._error(Unavailable("session", why, self._retry_after()), request)
        else:
            closed = await self.close_peer(resource, token)
        if closed is None:
            return self._error(Unauthenticated("token", REFUSED), request)
        return Response(status_code=200 if closed else 404, headers=self._cors(request))

    async def close_peer(self, resource: str, token: str | None) -> bool | None:
        """Close a WHEP peer of this replica: True, False where there is none, None for a wrong token."""
        made_with = self._tokens.get(resource)
        if made_with is None:
            return False
        if token is None or not hmac.compare_digest(token.encode(), made_with.encode()):
            return None
        self._tokens.pop(resource, None)
        return self._peers is not None and await self._peers.close(resource.split(".", 1)[1])

    def preflight(self, request: Request) -> Response:
        return Response(status_code=204, headers=self._cors(request, preflight=True))

    def _cors(self, request: Request | None, preflight: bool = False) -> dict:
        """CORS only for the configured origins (watch.allowed_origins); the watch page is same-origin."""
        origin = None if request is None else request.headers.get("origin")
        if origin is None or origin not in self.service.config.watch.allowed_origins:
            return {}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Expose-Headers": "Location"}
        if preflight:
            headers |= {
                "Access-Control-Allow-Methods": "POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Max-Age": "600",
            }
        return headers

    def peers(self):
        if self._peers is None:
            from vae_service.serving.viewers.peer_loop import PeerLoop

            self._peers = PeerLoop(self.service.config.watch)
        return self._peers

    def drain(self) -> None:
        """The replica drains: the viewers it relays end `moved` (they come back through another
        replica; its own sessions' viewers are told so as each session leaves)."""
        for relayed in list(self._relayed):
            relayed.feed.end("moved")
            relayed.stop()

    async def close_all(self) -> None:
        self.drain()
        if self._peers is not None:
            await self._peers.close_all()


def _offer(body: bytes, content_type: str | None) -> str:
    try:
        return read_offer(body, content_type)
    except InvalidInput as exc:
        if exc.field == "Content-Type":
            raise UnsupportedMediaType("Content-Type", "a WHEP offer is application/sdp") from None
        raise


class Acks:
    """What a MediaSource viewer says it has received: the text `{"ack": <frame>}` for each fragment
    (its first frame). Proxies stand between a replica and a browser (Serve's own among them) and
    take whatever is sent, however slowly the browser reads: the viewer's own word is the only
    measure of how far behind it is. Past `window` fragments unacknowledged nothing more is sent,
    so its queue (serving/viewers/feed.py) fills and drops to the next keyframe."""

    def __init__(self, window: int):
        self.window, self.unacked, self.changed = window, collections.deque(), asyncio.Event()

    def sent(self, frame: int) -> None:
        self.unacked.append(frame)

    @property
    def full(self) -> bool:
        return len(self.unacked) >= self.window

    async def read(self, ws: WebSocket) -> None:
        """Reads the viewer's acks until it goes (anything else it sends is ignored)."""
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None or len(text) > MAX_TOKEN_MESSAGE:
                continue
            try:
                frame = json.loads(text).get("ack")
            except (ValueError, AttributeError):
                continue
            # an ack of a fragment not sent yet acknowledges nothing (it would open the window unread)
            if type(frame) is int and self.unacked and frame <= self.unacked[-1]:
                while self.unacked and self.unacked[0] <= frame:
                    self.unacked.popleft()
                self.changed.set()


async def _next_with_room(viewer: Viewer, acks: Acks):
    """The viewer's next fragment once its window has room; None at its stream's end even while the
    window is full (what it has not taken then is dropped: a viewer that stopped acknowledging ends)."""
    while acks.full and viewer.ended is None:
        acks.changed.clear()
        ended = asyncio.ensure_future(viewer.wait_ended())
        acked = asyncio.ensure_future(acks.changed.wait())
        try:
            await asyncio.wait({ended, acked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            acked.cancel()
    if acks.full:
        return None
    return await viewer.next()


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    try:
        await ws.close(code, reason)
    except (RuntimeError, WebSocketDisconnect):  # already closed by the viewer
        pass
