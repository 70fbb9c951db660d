"""Viewers who land on a replica that does not hold their session.

Serve's HTTP proxy routes a viewer by nothing a browser can set (a WebSocket from a page carries no
custom header), so with several replicas a viewer may reach one without the session. That replica
relays: it asks the session's replica for the viewer's stream through a Serve handle (the session
router sends the call there, by the session's id, as it sends the session's own calls), and serves
the viewer from its own bounded queue. The session's replica treats the relay as one viewer (its
token checked there, its limits counted there); the landing replica's queue absorbs a slow viewer,
so the relay never backs up into the session's replica. Relayed rather than redirected: a browser's
WebSocket follows no redirect, and the viewer keeps one address whatever replica holds the session.

`owner_items` is the session's replica's side, `RelayedViewer` the landing replica's; both are
framework-free (the handle call is the replica's, serving/replica.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from vae_service.engine.request.errors import Overloaded, Unavailable
from vae_service.protocol.errors import Unauthenticated
from vae_service.serving.viewers.feed import STREAM, SessionFeed, Viewer
from vae_service.serving.viewers.hub import REFUSED, ViewerHub

log = logging.getLogger("ray.serve")
RemoteStream = Callable[[str, str | None, str], AsyncIterator[dict]]


async def owner_items(
    hub: ViewerHub, watch_id: str, token: str | None, kind: str, hold: Callable[[], Callable[[], None]]
) -> AsyncIterator[dict]:
    """The session's replica: `joined` (or `refused`, as the local routes would refuse: the token
    first, then the room), then each fragment (`start` before the first: the file's init segment and
    type), then `ended`. `hold` takes what the relay holds here while it lasts (a session connection:
    it is one of Serve's ongoing requests) and returns its release; it raises Overloaded."""
    try:
        feed = hub.authorize(watch_id, token)
        release = hold()
    except Unauthenticated:
        yield {"refused": "unauthenticated"}
        return
    except Overloaded as exc:
        yield {"refused": "viewers", "message": exc.message, "retry_after_s": exc.retry_after_s}
        return
    try:
        viewer = hub.join(feed, kind)
    except Overloaded as exc:
        release()
        yield {"refused": "viewers", "message": exc.message, "retry_after_s": exc.retry_after_s}
        return
    try:
        yield {"joined": watch_id, "frame": feed.frames}
        started = False
        while (fragment := await viewer.next()) is not None:
            if not started:
                yield {"start": {"init": feed.init, "content_type": feed.content_type}}
                started = True
            if kind == STREAM:  # a MediaSource viewer needs no pixels: they would cross the cluster for nothing
                fragment = replace(fragment, pixels=fragment.pixels[:0])
            yield {"fragment": fragment, "dropped": viewer.dropped}
        yield {"ended": viewer.ended, "frames": feed.frames}
    finally:
        hub.leave(feed, viewer)
        release()


class RelayedViewer:
    """The landing replica's side: a one-viewer feed filled from the session's replica."""

    def __init__(self, watch_id: str, kind: str, bound: int, on_drop: Callable[[int], None]):
        self.feed = SessionFeed(watch_id, "", bound, on_drop, watch_id)
        self.viewer: Viewer = self.feed.join(kind)
        self._task: asyncio.Task | None = None
        self._response = None

    async def start(self, remote: RemoteStream, token: str | None, timeout_s: float) -> None:
        """Joins on the session's replica within `timeout_s`; raises its refusal (Unauthenticated,
        Overloaded), or Unavailable where it did not answer in time."""
        self._response = remote(self.feed.watch_id, token, self.viewer.kind)
        items = self._response.__aiter__()
        try:
            first = await asyncio.wait_for(items.__anext__(), timeout_s)
        except TimeoutError:
            self.stop()
            raise Unavailable("session", "the replica holding the session did not answer in time: retry", 1.0) from None
        if "refused" in first:
            self.stop()
            if first["refused"] == "viewers":
                raise Overloaded("viewers", first["message"], first["retry_after_s"])
            raise Unauthenticated("token", REFUSED)
        self.feed.frames = first.get("frame", 0)
        self._task = asyncio.ensure_future(self._pump(items))

    async def _pump(self, items: AsyncIterator[dict]) -> None:
        reason = "lost"
        try:
            async for item in items:
                if "start" in item:
                    self.feed.init, self.feed.content_type = item["start"]["init"], item["start"]["content_type"]
                elif "fragment" in item:
                    self.feed.publish([item["fragment"]], self.feed.init, self.feed.content_type)
                elif "ended" in item:
                    reason = item["ended"] or "lost"
                    self.feed.frames = item["frames"]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the session's replica went away mid-stream
            log.info("a relayed viewer's stream of watch %s ended: %s", self.feed.watch_id, exc)
        finally:
            self.feed.end(reason)

    def stop(self) -> None:
        """Ends the relay on both sides: the session's replica's call is cancelled (a streaming call
        dropped unread goes on producing until cancelled)."""
        if self._task is not None:
            self._task.cancel()
        cancel = getattr(self._response, "cancel", None)
        if cancel is not None:
            cancel()
