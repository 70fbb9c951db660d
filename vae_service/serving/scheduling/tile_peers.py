"""The deployment's replicas as the engine's TilePeers (engine/execution/tile_executor.py): a tile offered to
the deployment goes through its own handle (Serve's router picks the least loaded replica) to the
replica's `decode_tile_job`, a streaming method that answers at once whether it takes the tile
(`Accepted`, or `OfferRefused` and why), then the tile's output chunk by chunk and `End`. What a replica
takes and how it decodes it is DecodeService.tile's (serving/decode_service.py): one tile at a time,
only while its device is idle, on its device thread.

Each offered tile is read on the replica's event loop into a queue of at most `CHUNKS_AHEAD`
messages the engine has not taken: the engine polls it in slices that check the request. Serve's
streaming transport (Ray's streaming generator, whose backpressure Serve does not expose) passes on
what the replica sends whether or not it was read; the replica sends at most its tile's output, and
the engine reads the tiles in lockstep.

Faults, as the engine needs them told apart: anything a replica raised is a bug (logged there and
here, 500 for the request, never its text on the wire), but for Serve's overload; everything else
(a replica that died, an overloaded deployment, a cancelled or short stream, a transport error) is
`TileLost`, decoded once more."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future

from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError

from vae_service.engine.execution.peer_contract import (
    Accepted,
    Chunk,
    End,
    Lost,
    OfferRefused,
    TileCall,
    TileLost,
    TileRefused,
)
from vae_service.engine.runtime.tile_jobs import TileJob, on_host

log = logging.getLogger("ray.serve")

CHUNKS_AHEAD = 2  # messages of one tile read from Serve's stream and not yet taken by the engine


# what Serve and Ray raise when a replica or the deployment cannot answer: decoded once more
LOST = (RayActorError, BackPressureError, DeploymentUnavailableError, RequestCancelledError, ConnectionError)


class ReplicaPeers:
    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s
        self.loop: asyncio.AbstractEventLoop | None = None  # the replica's, where answers are read
        self._handle = None

    def _deployment(self):
        if self._handle is None:  # on first use: the replica context exists only once the replica runs
            context = serve.get_replica_context()
            handle = serve.get_deployment_handle(context.deployment, context.app_name)
            self._handle = handle.options(stream=True)
        return self._handle

    def offer(self, job: TileJob, call: TileCall) -> RemoteStream:
        job, fingerprint, remaining_s = on_host(job), call.fingerprint, call.context.remaining()
        remote = RemoteStream()
        remote.start(lambda: self._deployment().decode_tile_job.remote(job, fingerprint, remaining_s), self.loop)
        return remote


class RemoteStream:
    """One offered tile's messages (the engine's RemoteTile): sent and read on the replica's event
    loop (a streaming response read on a thread of its own failed about once in fifty in Ray 2.60:
    "Ray objects whose owner is unknown"), polled from the device thread."""

    def __init__(self) -> None:
        self._messages: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(CHUNKS_AHEAD)
        self._reading: Future | None = None
        self._ended = False

    def start(self, send, loop: asyncio.AbstractEventLoop) -> None:
        self._reading = asyncio.run_coroutine_threadsafe(self._read(send), loop)

    async def _read(self, send) -> None:
        try:
            response = send()
        except Exception as error:  # no controller, no replica: nobody takes it
            self._messages.put(OfferRefused(f"{type(error).__name__}: {error}"))
            return
        try:
            async for message in response:
                while not self._room.acquire(blocking=False):  # the engine has CHUNKS_AHEAD unread
                    await asyncio.sleep(0.01)
                self._messages.put(message)
            self._messages.put(None)  # the stream's end
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as error:
            self._messages.put(error)

    def poll(self, timeout_s: float):
        try:
            item = self._messages.get(timeout=timeout_s) if timeout_s > 0 else self._messages.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, Accepted | Chunk | End):
            self._room.release()
            self._ended = self._ended or isinstance(item, End)
            return item
        if isinstance(item, OfferRefused):
            raise TileRefused(item.reason)
        if isinstance(item, Lost):
            raise TileLost(item.reason)
        if item is None:
            if self._ended:
                return None
            raise TileLost("its stream ended short")
        if isinstance(item, RayTaskError) and not isinstance(item, LOST):
            raise item  # the replica raised it: a bug there
        raise TileLost(f"{type(item).__name__}: {item}")  # the transport failed: the replica went away, say

    def cancel(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
