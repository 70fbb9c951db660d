"""A replica's WHEP peers on an event loop and a thread of their own.

aiortc encodes each frame it sends in its event loop's default executor. On the replica's own loop
that is the pool the decode path's `to_thread` calls wait in (a chunk's check, the deadline's
wait, a session's export): a few dozen viewers' VP8 encodes would queue ahead of them and slow the
decode. On a loop of their own, the peers' encodes take their own pool, and the replica's loop only
hands them frames.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import numpy as np

from vae_service.config import Watch
from vae_service.serving.viewers.webrtc import WhepPeers


class PeerLoop:
    """WhepPeers' API, called from the replica's loop, run on the peers' own."""

    def __init__(self, watch: Watch):
        self.peers = WhepPeers(watch)  # its ICE settings checked here, on the caller's thread
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vae-whep-peers", daemon=True)
        self.thread.start()

    @property
    def count(self) -> int:
        return self.peers.count

    async def _there(self, work: Awaitable):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop))

    async def answer(
        self, offer_sdp: str, next_frame: Callable[[], Awaitable[np.ndarray | None]], on_end: Callable[[], None]
    ) -> tuple[str, str]:
        """WhepPeers.answer, its frames fetched from (and its end told to) the calling loop."""
        home = asyncio.get_running_loop()

        async def frame_from_home() -> np.ndarray | None:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(next_frame(), home))

        def end_at_home() -> None:
            if not home.is_closed():
                home.call_soon_threadsafe(on_end)

        return await self._there(self.peers.answer(offer_sdp, frame_from_home, end_at_home))

    async def close(self, resource_id: str) -> bool:
        return await self._there(self.peers.close(resource_id))

    async def close_all(self) -> None:
        await self._there(self.peers.close_all())
