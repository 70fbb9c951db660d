"""Where a replica takes tiles of other replicas' requests (engine/execution/tile_executor.py's
SharedTiles offers them; serving/scheduling/tile_peers.py carries them): `OfferRefused` at once unless this
replica is free for the tile, else `Accepted`, the job's output chunk by chunk, `End`.

Free: the same fingerprint (else it would decode other bits), time left, no tile of any request
here already, the device idle (no batch running or queued: a tile never runs beside one), and the
tile's price within this replica's own bound. A taken tile runs as an `interactive` decode of the
scheduler's own (serving/scheduling/scheduler.py): a more urgent batch arriving meanwhile runs its
steps between the tile's chunks, anything else waits for the tile; at most
TILE_CHUNKS_AHEAD chunks ahead of what was sent; the request's deadline, or the stream's
cancellation (the requester left or finished), stops it at its next decoder call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import closing

import torch

from vae_service.config import Limits
from vae_service.engine import DecodeEngine
from vae_service.engine.execution.call import DecodeCall, wait_off_device
from vae_service.engine.execution.peer_contract import Accepted, Chunk, End, Lost, OfferRefused
from vae_service.engine.request.context import WAIT_SLICE_S, RequestContext
from vae_service.engine.request.errors import DecodeTimeout
from vae_service.engine.runtime.tile_jobs import TileJob
from vae_service.serving.scheduling.classes import INTERACTIVE
from vae_service.serving.scheduling.device_turns import StepPrice, Turn
from vae_service.serving.scheduling.scheduler import StepScheduler

TILE_CHUNKS_AHEAD = 2  # a taken tile's chunks decoded and not yet sent: the decode waits for the send


class TileSurface:
    def __init__(
        self,
        engine: DecodeEngine,
        scheduler: StepScheduler,
        device_busy: Callable[[], bool],
        limits: Callable[[], Limits],
    ):
        self.engine, self.scheduler = engine, scheduler
        self.device_busy, self.limits = device_busy, limits  # the replica's batches; its live limits
        self.taken = False  # this replica decodes a tile of another's request now

    async def tile(self, job: TileJob, fingerprint: str, remaining_s: float, replica: str) -> AsyncIterator:
        why = self.cannot_take(job, fingerprint, remaining_s)
        if why is not None:
            yield OfferRefused(why)
            return
        self.taken = True
        context = RequestContext(time.monotonic() + remaining_s, self.limits(), fingerprint)
        loop, sent, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        room = threading.Semaphore(TILE_CHUNKS_AHEAD)

        def decode(turn: Turn) -> None:
            call = DecodeCall([context], fingerprint, batch_gone=stop, running_members=(0,), steps=turn)
            try:
                # closed here however it ends: its inference mode and gate are this thread's to restore
                with call.running(), closing(self.engine.run_tile(job, fingerprint)) as chunks:
                    while call.checkpoint() or (pixels := next(chunks, None)) is not None:
                        host = pixels.cpu()
                        if not room.acquire(blocking=False):  # its reader is behind: wait off the device
                            wait_off_device(lambda: wait_for_room(room, call))
                        loop.call_soon_threadsafe(sent.put_nowait, host)
            finally:
                loop.call_soon_threadsafe(sent.put_nowait, None)

        price = StepPrice(self.engine.cost.job_peak(job) or 0, 0)
        decoding = asyncio.ensure_future(self.scheduler.run_alone(decode, INTERACTIVE, context.deadline, price))
        count = 0
        try:
            yield Accepted(replica)
            while (pixels := await sent.get()) is not None:
                room.release()
                count += 1
                yield Chunk(pixels)
            try:
                await decoding
            except torch.OutOfMemoryError:
                yield Lost("this replica ran out of device memory for the tile")
                return
            except DecodeTimeout:
                return  # its deadline passed (the requester answers 504) or nobody reads it any more
            yield End(count)
        finally:
            stop.set()
            await asyncio.wait({decoding})
            decoding.exception()  # retrieved: seen above or of no interest once the reader left
            self.taken = False

    def cannot_take(self, job: TileJob, fingerprint: str, remaining_s: float) -> str | None:
        engine = self.engine
        if why := engine.decodes_otherwise(fingerprint):
            return why
        if remaining_s <= 0:
            return "the request's deadline passed before the tile arrived"
        if self.taken or self.device_busy():
            return "busy: its device is not idle"
        need, bound = engine.cost.job_peak(job), engine.cost.bound(self.limits())
        if need is not None and need > bound:
            return f"the tile needs about {need / 2**30:.3g} GiB, over this replica's max_decode_bytes"
        return None


def wait_for_room(room: threading.Semaphore, call: DecodeCall) -> None:
    while not room.acquire(timeout=WAIT_SLICE_S):
        call.check()  # the decode stops once nobody reads it
