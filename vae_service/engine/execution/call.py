"""One engine call's own state: its requests' contexts (when to stop), the run being decoded, the
host copies it queued, and the replicas its tiles may go to. The engine keeps none of this, so calls from several
threads cannot see each other's; the checkpoint hook finds the call running on its thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from vae_service.engine.execution.peer_contract import TileCall, TilePeers
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout


class StepGate(Protocol):
    """The device's scheduler, seen from a decode (the serving layer's DeviceTurns): at a step
    boundary it may run more urgent work's steps first, this decode suspended meanwhile; `check`
    runs while it waits (a decode nobody waits for stops there)."""

    def between_steps(self, check: Callable[[], None]) -> None: ...

    def aside(self, wait: Callable[[], None]) -> None:
        """Give the device up while `wait()` runs (the decode waits for something off the device:
        a stream's reader), then take a turn again."""


@dataclass
class DecodeCall:
    contexts: list[RequestContext]  # the batch's requests', in order
    fingerprint: str
    batch_gone: threading.Event | None = None  # the scheduler's: every caller of the batch left
    host_copies: list | None = None  # CUDA events of the copies queued; None: each copy waited for
    peers: TilePeers | None = None  # the deployment's replicas, which take tiles (engine/execution/tile_executor.py)
    decoded_by: set = field(default_factory=set)  # ids of the replicas that decoded tiles of it
    running_members: tuple[int, ...] = ()  # the requests of the run being decoded
    tiled: set = field(default_factory=set)  # the requests decoded in tiles (an optional tiling may not be)
    fell_back: dict = field(
        default_factory=dict
    )  # request -> its items decoded again in fp32 (engine/execution/fallback.py)
    steps: StepGate | None = None  # the scheduler's turns (None: this call has the device to itself)

    @property
    def replicas(self) -> int:
        """Replicas whose decoders worked on this call: this one, and those its tiles went to."""
        return 1 + len(self.decoded_by)

    def gone(self, i: int) -> bool:
        """Nobody waits for request `i` any more (its deadline passed, or its caller left)."""
        return self.contexts[i].ended

    @property
    def all_gone(self) -> bool:
        """The scheduler says every caller of the batch left (checked once a decoder call)."""
        return self.batch_gone is not None and self.batch_gone.is_set()

    def ended_error(self, i: int) -> DecodeTimeout:
        """What request `i` is answered with once nobody waits for it."""
        if self.contexts[i].expired:
            return DecodeTimeout("body", "not decoded within request_timeout_s")
        return DecodeAbandoned("body", "every caller of this decode timed out or went away")

    def checkpoint(self) -> None:
        """A step boundary (a run or item of images, a tile, a latent frame; every decoder call of an
        image decoder): stops the run once every request in it timed out or went away, else lets
        the scheduler run more urgent work first, this call's state kept as it is."""
        self.check()
        if self.steps is not None:
            self.steps.between_steps(self.check)

    def check(self) -> None:
        """Runs before every decoder call (and each call a decoder's own `decode` makes: temporal
        tiles, frame batches): stops the run once every request in it timed out or went away."""
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
    """The check of the call running on this thread (none: a decode the engine runs for itself, on
    the meta twin or at start-up)."""
    call = _RUNNING.get()
    if call is not None:
        call.check()


def step_running_call() -> None:
    """The checkpoint (a step boundary) of the call running on this thread."""
    call = _RUNNING.get()
    if call is not None:
        call.checkpoint()


def wait_off_device(wait: Callable[[], None]) -> None:
    """`wait()`, the device given to other decodes meanwhile where the call running on this thread
    takes turns (between two of its steps only)."""
    call = _RUNNING.get()
    if call is None or call.steps is None:
        wait()
    else:
        call.steps.aside(wait)


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
    """A forward pre-hook for a video-latent decoder: the running call's check before each of its
    forwards, wherever the model's own `decode` calls it from. Never a step boundary: such a
    decoder's own loops may keep state on the module between forwards (a causal cache), which
    another decode's steps would overwrite; its steps are the engine's chunks (latent frames)."""
    check_running_call()


def step_hook(module, args) -> None:
    """A forward pre-hook for an image decoder: each forward is a step (a batch, an item, a tile of
    the class's tiled decode); nothing lives on the module between two."""
    step_running_call()


def decoder_hook(video_latents: bool) -> Callable:
    return checkpoint_hook if video_latents else step_hook
