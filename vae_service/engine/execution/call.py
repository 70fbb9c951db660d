"""One engine call's own state: its requests' contexts (when to stop), the run being decoded, the
host copies it queued, and the replicas its tiles may go to. The engine keeps none of this, so calls from several
threads cannot see each other's; the checkpoint hook finds the call running on its thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from vae_service.engine.execution.peer_contract import TileCall, TilePeers
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout


@dataclass
class DecodeCall:
    contexts: list[RequestContext]  # the batch's requests', in order
    fingerprint: str
    batch_gone: threading.Event | None = None  # the batcher's: every caller of the batch left
    host_copies: list | None = None  # CUDA events of the copies queued; None: each copy waited for
    peers: TilePeers | None = None  # the deployment's replicas, which take tiles (engine/execution/tile_executor.py)
    decoded_by: set = field(default_factory=set)  # ids of the replicas that decoded tiles of it
    running_members: tuple[int, ...] = ()  # the requests of the run being decoded
    tiled: set = field(default_factory=set)  # the requests decoded in tiles (an optional tiling may not be)
    fell_back: dict = field(
        default_factory=dict
    )  # request -> its items decoded again in fp32 (engine/execution/fallback.py)

    @property
    def replicas(self) -> int:
        """Replicas whose decoders worked on this call: this one, and those its tiles went to."""
        return 1 + len(self.decoded_by)

    def gone(self, i: int) -> bool:
        """Nobody waits for request `i` any more (its deadline passed, or its caller left)."""
        return self.contexts[i].ended

    @property
    def all_gone(self) -> bool:
        """The batcher says every caller of the batch left (checked once a decoder call)."""
        return self.batch_gone is not None and self.batch_gone.is_set()

    def ended_error(self, i: int) -> DecodeTimeout:
        """What request `i` is answered with once nobody waits for it."""
        if self.contexts[i].expired:
            return DecodeTimeout("body", "not decoded within request_timeout_s")
        return DecodeAbandoned("body", "every caller of this decode timed out or went away")

    def checkpoint(self) -> None:
        """Runs before every decoder call (an item, a tile, a latent frame, and each call a
        decoder's own `decode` makes: temporal tiles, frame batches): stops the run once every
        request in it timed out or went away."""
        if self.all_gone:
            raise DecodeAbandoned("body", "every caller of this decode timed out or went away")
        members = self.running_members
        if members and all(self.gone(i) for i in members):
            raise self.ended_error(members[0])

    def tile_call(self, i: int) -> TileCall:
        return TileCall(self.contexts[i], self.fingerprint, self.decoded_by)

    @contextmanager
    def running(self) -> Iterator[None]:
        """This call is the one running on this thread (checkpoint_hook reads it)."""
        token = _RUNNING.set(self)
        try:
            yield
        finally:
            _RUNNING.reset(token)


_RUNNING: ContextVar[DecodeCall | None] = ContextVar("vae_service_decode_call", default=None)


def check_running_call() -> None:
    """The checkpoint of the call running on this thread (none: a decode the engine runs for
    itself, on the meta twin or at start-up)."""
    call = _RUNNING.get()
    if call is not None:
        call.checkpoint()


def checked_chunks(chunks: Iterator, checkpoint: Callable[[], None] = check_running_call) -> Iterator:
    """`chunks` with `checkpoint` before each one's work (next() runs it): for decodes whose
    decoder's forward is never called (the Wan walk calls its modules one by one)."""
    while True:
        checkpoint()
        out = next(chunks, None)
        if out is None:
            return
        yield out


def checkpoint_hook(module, args) -> None:
    """A forward pre-hook for a decoder: the running call's checkpoint before each of its forwards,
    wherever the model's own `decode` calls it from."""
    check_running_call()
