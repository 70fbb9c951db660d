"""Replicas without Ray, for unit tests of shared tiles: each `Replica` is a real DecodeService (its
engine, batcher, device thread and `tile` method) on an event loop of its own thread; `Deployment`
is the engine's TilePeers over them, with the transport of serving/scheduling/tile_peers.py (RemoteStream) and
a router like Serve's (the replica with the fewest requests in it). Only the transport between them
is a stand-in, and the faults it injects: a replica that dies after some messages, hangs, or fails
with a bug."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import replace

from ray.exceptions import RayTaskError

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine
from vae_service.engine.planning.tiling import TileGrid
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.scheduling.tile_peers import RemoteStream

_END = object()


class Replica:
    def __init__(self, name: str, engine: DecodeEngine, config: ServiceConfig | None = None):
        self.name, self.ongoing = name, 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name=f"replica-{name}").start()
        config = config or ServiceConfig(model="tiny-kl", device="cpu", serving={"fit_prices_at_start": False})
        self.service = DecodeService(config, engine)
        self.fault: Fault | None = None
        self.took: list = []  # the jobs it accepted

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def decode(self, request):
        """A request of its own (it is then busy), through its batcher, as Serve would send it."""
        return asyncio.run_coroutine_threadsafe(self.service.decode(request), self.loop)

    def stream(self, job, fingerprint: str, remaining_s: float) -> Stream:
        return Stream(self, job, fingerprint, remaining_s)


class Fault:
    """`die_after`: the replica dies after that many messages; `hang_after`: it sends no more after
    that many (0: it never answers); `bug`: it raises a bug instead of answering; `late_s`: the
    offer reaches the replica that late (Serve still routing it). For the next `times` tiles
    offered to it."""

    def __init__(
        self,
        die_after: int | None = None,
        hang_after: int | None = None,
        bug: bool = False,
        late_s: float = 0.0,
        times: int = 1,
    ):
        self.die_after, self.hang_after, self.bug, self.late_s = die_after, hang_after, bug, late_s
        self.times = times


class Stream:
    """Serve's streaming response of `decode_tile_job`: the replica's generator run as one task on
    its loop (cancel() cancels it, as Serve does), its messages read in order (`async for`)."""

    def __init__(self, replica: Replica, job, fingerprint: str, remaining_s: float):
        self.replica, self.messages, self.fault = replica, queue.Queue(), None
        if replica.fault is not None and replica.fault.times > 0:
            replica.fault.times -= 1
            self.fault = replica.fault
        replica.ongoing += 1
        self.task = asyncio.run_coroutine_threadsafe(self._run(job, fingerprint, remaining_s), replica.loop)

    async def _run(self, job, fingerprint, remaining_s) -> None:
        replica, sent = self.replica, 0
        try:
            fault = self.fault or Fault()
            if fault.bug:  # as Ray hands over what a replica raised
                raise RayTaskError("decode_tile_job", "Traceback: a bug in the replica", ZeroDivisionError())
            if fault.hang_after == 0:
                await asyncio.Event().wait()
            await asyncio.sleep(fault.late_s)
            async for message in replica.service.tile(job, fingerprint, remaining_s, replica.name):
                if fault.die_after == sent:
                    raise ConnectionError("the replica died")
                if fault.hang_after == sent:
                    await asyncio.Event().wait()
                if type(message).__name__ == "Accepted":
                    replica.took.append(job)
                self.messages.put(message)
                sent += 1
            self.messages.put(_END)
        except Exception as error:
            self.messages.put(error)
        finally:
            replica.ongoing -= 1

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await asyncio.to_thread(self.messages.get)
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.replica.loop.call_soon_threadsafe(self.task.cancel)
        self.messages.put(_END)


class Deployment:
    """The engine's TilePeers over `replicas`: each offer goes to the replica with the fewest
    requests in it (Serve's router), through serving/scheduling/tile_peers.py's RemoteStream."""

    def __init__(self, replicas: list[Replica], retry_after_s: float = 1.0):
        self.replicas, self.retry_after_s = replicas, retry_after_s
        self.loop = asyncio.new_event_loop()  # where answers are read, as on a replica's loop
        threading.Thread(target=self.loop.run_forever, daemon=True, name="requester-loop").start()
        self.offers, self.sent = 0, []  # (fingerprint, time left) of each offer

    def offer(self, job, call) -> RemoteStream:
        self.offers += 1
        self.sent.append((call.fingerprint, call.context.remaining()))
        replica = min(self.replicas, key=lambda r: r.ongoing)
        remote, remaining_s = RemoteStream(), call.context.remaining()
        remote.start(lambda: replica.stream(job, call.fingerprint, remaining_s), self.loop)
        return remote


def replicas_of(engines: list[DecodeEngine]) -> list[Replica]:
    return [Replica(f"peer-{i}", engine) for i, engine in enumerate(engines)]


def here_only(prepared):
    """The same plan with every tile decoded by this engine: an optional grid (one that fits whole,
    tiled only to share it) made plain, as one replica decodes it when its replicas take tiles."""
    if isinstance(prepared.tiling, TileGrid):
        return replace(prepared, tiling=replace(prepared.tiling, optional=False))
    return prepared
