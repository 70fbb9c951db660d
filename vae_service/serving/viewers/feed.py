"""One watched session's frames, fanned out to its viewers without ever holding the session back.

The session publishes each chunk once (`SessionFeed.publish`): its mp4/webm fragments (one per
latent frame, each beginning with a keyframe) and their pixels. Each viewer has its own bounded
queue of fragments; publishing never waits for a viewer. A viewer still holding `bound` fragments
when the next chunk comes drops that backlog and goes on at the chunk's first fragment: a keyframe, so its
picture recovers at once (a MediaSource viewer appends in `sequence` mode: no gap in its timeline).
What each viewer dropped is counted. A viewer joining late starts at the next fragment published.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

STREAM, WEBRTC = "stream", "webrtc"  # a viewer's kind: MediaSource over WebSocket, or WHEP


@dataclass(frozen=True)
class Fragment:
    """One latent frame's frames as a viewer gets them."""

    frame: int  # the session's index of its first frame
    frames: int
    data: bytes  # the mp4 fragment (moof + mdat) or WebM Cluster, without the init segment
    pixels: np.ndarray  # [frames, H, W, 3] uint8: what the WebRTC viewers encode
    chunk_ms: float  # wall-clock ms (epoch) the chunk reached the service: the viewer's latency base


class Viewer:
    """One viewer's queue. `next()` waits for the next fragment (None: the stream ended, `ended`
    says why); never more than `bound` (less one) and a chunk's fragments wait."""

    def __init__(self, kind: str, bound: int, on_drop: Callable[[int], None] = lambda n: None):
        self.kind, self.bound, self.on_drop = kind, bound, on_drop
        self.queue: collections.deque[Fragment] = collections.deque()
        self.dropped = 0  # fragments this viewer never got: it fell `bound` behind
        self.sent = 0
        self.ended: str | None = None
        self._wake = asyncio.Event()
        self._ended = asyncio.Event()

    def offer(self, fragments: list[Fragment]) -> None:
        """A chunk's fragments (they come together): a viewer still holding `bound` from before
        drops those first."""
        if self.ended is not None or not fragments:
            return
        if len(self.queue) >= self.bound:
            self.dropped += len(self.queue)
            self.on_drop(len(self.queue))
            self.queue.clear()
        self.queue.extend(fragments)
        self._wake.set()

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
            self._wake.set()
            self._ended.set()

    async def wait_ended(self) -> None:
        await self._ended.wait()

    async def next(self) -> Fragment | None:
        while not self.queue:
            if self.ended is not None:
                return None
            self._wake.clear()
            await self._wake.wait()
        self.sent += 1
        return self.queue.popleft()


class FramePacer:
    """A WebRTC viewer's frames one at a time, at the session's frame rate: a chunk's frames arrive
    together, and a browser shows a WebRTC frame when it arrives; behind by a whole queue, the
    viewer drops to the newest fragment (Viewer.offer) rather than playing late."""

    def __init__(self, viewer: Viewer, fps: float, clock=time.monotonic):
        self.viewer, self.period, self.clock = viewer, 1.0 / fps, clock
        self.pending: collections.deque[np.ndarray] = collections.deque()
        self.due = 0.0

    async def next_frame(self) -> np.ndarray | None:
        if not self.pending:
            fragment = await self.viewer.next()
            if fragment is None:
                return None
            self.pending.extend(fragment.pixels)
            self.due = max(self.due, self.clock())
        wait = self.due - self.clock()
        if wait > 0:
            await asyncio.sleep(wait)
        self.due += self.period
        return self.pending.popleft()


class SessionFeed:
    """A watched session's viewers, its token and what a joining MediaSource viewer needs first."""

    def __init__(
        self,
        session_id: str,
        token: str,
        bound: int,
        on_drop: Callable[[int], None] = lambda n: None,
        watch_id: str = "",
    ):
        self.session_id, self.token, self.bound, self.on_drop = session_id, token, bound, on_drop
        self.watch_id = watch_id  # what its viewers know it by (serving/viewers/hub.py)
        self.viewers: set[Viewer] = set()
        self.init: bytes | None = None  # the file's init segment, known with its first fragment
        self.content_type: str | None = None  # with codecs, as MediaSource.isTypeSupported takes it
        self.frames = 0  # frames published so far: where a joining viewer's stream starts
        self.last: Fragment | None = None  # what a joining WebRTC viewer is shown first
        self.ended: str | None = None

    def publish(self, fragments: list[Fragment], init: bytes, content_type: str) -> None:
        self.init, self.content_type = init, content_type
        for viewer in self.viewers:
            viewer.offer(fragments)
        if fragments:  # a copy of one frame: a view would keep the whole chunk's pixels for the session's life
            self.last = replace(fragments[-1], pixels=fragments[-1].pixels[-1:].copy())
            self.frames = self.last.frame + self.last.frames

    def join(self, kind: str) -> Viewer:
        """A MediaSource viewer starts at the next fragment (its file's timeline from a keyframe on);
        a WebRTC viewer at the latest one's last frame, so a picture shows at once between chunks."""
        viewer = Viewer(kind, self.bound, self.on_drop)
        if kind == WEBRTC and self.last is not None and self.ended is None:
            last = self.last
            viewer.offer([replace(last, frame=last.frame + last.frames - 1, frames=1)])
        if self.ended is not None:
            viewer.end(self.ended)
        self.viewers.add(viewer)
        return viewer

    def leave(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)

    def end(self, reason: str) -> None:
        """The session closed, expired, was lost or moved: every viewer's stream ends (after what it
        has queued) saying so."""
        self.ended = reason
        for viewer in self.viewers:
            viewer.end(reason)
