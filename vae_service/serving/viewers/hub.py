"""A replica's watched sessions: their tokens, their viewers and the limits on them.

A watched session is known to its viewers by a watch id of its own, not its session id (which
attaches to the session: a viewer may watch, never drive it); the id begins with the replica that
opened it, as a session id does, so the request router sends a relay there (serving/viewers/relay.py),
and the session keeper knows it as the session's alias once it moved. A watch token is a
per-session capability: unguessable (256 random bits), compared in constant time, gone with its
session (closed, expired, lost; a session that moves takes both along). Whoever asks for a session
that is not watched here, with a wrong token or none, gets the same refusal (`Unauthenticated`: 401)
after the same comparisons, so a viewer learns nothing about which sessions exist. The service's own
bearer token watches every session (`service_token`).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

from vae_service.config import Watch
from vae_service.engine.request.errors import Overloaded
from vae_service.protocol.errors import Unauthenticated
from vae_service.serving.viewers.feed import Fragment, SessionFeed, Viewer

REFUSED = "a valid watch token is required ('Authorization: Bearer <token>' from the session's opened.watch)"
_NO_TOKEN = secrets.token_urlsafe(32)  # compared against when there is no session, so both refusals cost the same


def new_token() -> str:
    return secrets.token_urlsafe(32)


class ViewerHub:
    """`config`: the replica's watch settings now; `retry_after_s`: a refused viewer's Retry-After;
    `service_token`: whether a token is the service's own (it may watch any session)."""

    def __init__(
        self, config: Callable[[], Watch], retry_after_s: Callable[[], float], service_token: Callable[[str], bool]
    ):
        self.config, self.retry_after_s, self.service_token = config, retry_after_s, service_token
        self.feeds: dict[str, SessionFeed] = {}  # by session id
        self.watched: dict[str, str] = {}  # watch id -> session id
        self.refused = self.joined = 0
        self.dropped = 0  # fragments viewers never got (they fell a whole queue behind)
        self.relayed = 0  # viewers served here of sessions held by other replicas (serving/viewers/relay.py)

    def watch(self, session_id: str, token: str | None = None, watch_id: str | None = None) -> SessionFeed:
        """Make the session watchable here: a new watch id and token, or those it came with from
        another replica."""
        feed = self.feeds.get(session_id)
        if feed is None:
            watch_id = watch_id or f"{session_id.split('.', 1)[0]}.{secrets.token_hex(16)}"
            bound = self.config().viewer_queue_fragments
            feed = SessionFeed(session_id, token or new_token(), bound, self.count_drops, watch_id)
            self.feeds[session_id], self.watched[watch_id] = feed, session_id
        return feed

    def feed_of(self, session_id: str) -> SessionFeed | None:
        return self.feeds.get(session_id)

    def knows(self, watch_id: str) -> bool:
        return watch_id in self.watched

    def authorize(self, watch_id: str, token: str | None) -> SessionFeed:
        """The feed a viewer holding `token` watches by `watch_id`; Unauthenticated, the same for a
        wrong token, none, or a session not watched here (both comparisons made either way)."""
        feed = self.feeds.get(self.watched.get(watch_id, ""))
        given = (token or "").encode()
        matches = hmac.compare_digest(given, (feed.token if feed is not None else _NO_TOKEN).encode())
        service = token is not None and self.service_token(token)
        if feed is None or not (matches or service):
            self.refused += 1
            raise Unauthenticated("token", REFUSED)
        return feed

    def join(self, feed: SessionFeed, kind: str) -> Viewer:
        """A new viewer of an authorized feed; Overloaded naming `viewers` past either limit."""
        config = self.config()
        if len(feed.viewers) >= config.max_viewers_per_session:
            raise Overloaded(
                "viewers",
                f"this session has {len(feed.viewers)} viewers (watch.max_viewers_per_session); retry when one leaves",
                self.retry_after_s(),
            )
        self.check_room()
        self.joined += 1
        return feed.join(kind)

    def check_room(self) -> None:
        """Overloaded naming `viewers` where this replica serves watch.max_viewers already."""
        if self.viewer_count() >= self.config().max_viewers:
            raise Overloaded(
                "viewers",
                f"this replica serves {self.viewer_count()} viewers (watch.max_viewers); retry when one leaves",
                self.retry_after_s(),
            )

    def count_drops(self, fragments: int) -> None:
        self.dropped += fragments

    def leave(self, feed: SessionFeed, viewer: Viewer) -> None:
        feed.leave(viewer)

    def publish(self, session_id: str, fragments: list[Fragment], init: bytes, content_type: str) -> None:
        feed = self.feeds.get(session_id)
        if feed is not None:
            feed.publish(fragments, init, content_type)

    def end(self, session_id: str, reason: str) -> None:
        feed = self.feeds.pop(session_id, None)
        if feed is not None:
            self.watched.pop(feed.watch_id, None)
            feed.end(reason)

    def viewer_count(self) -> int:
        return self.relayed + sum(len(f.viewers) for f in self.feeds.values())

    def describe(self) -> dict:
        return {
            "watched_sessions": len(self.feeds),
            "viewers": self.viewer_count(),
            "relayed_viewers": self.relayed,
            "max_viewers": self.config().max_viewers,
            "viewers_joined": self.joined,
            "viewers_refused": self.refused,
            "fragments_dropped": self.dropped,
        }
