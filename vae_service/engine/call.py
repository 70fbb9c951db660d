"""One engine call's own state: its requests' contexts (when to stop), the run being decoded, the
host copies it queued, and where its tiles go. The engine keeps none of this, so calls from several
threads cannot see each other's; the checkpoint hook finds the call running on its thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vae_service.engine.context import RequestContext
from vae_service.engine.errors import DecodeAbandoned, DecodeTimeout


@dataclass
class TileCall:
    """What decoding a request's tiles elsewhere needs of it: its context (deadline, abandonment),
    the fingerprint a replica must have to decode them, and where to note which replicas did."""

    context: RequestContext
    fingerprint: str
    replicas: set = field(default_factory=set)


class TileSpreader(Protocol):
    """Decodes a request's tiles on other replicas (the serving layer's; the engine never imports
    Ray), each by `engine.decode_tile` or `engine.tile_chunks` there. A replica whose fingerprint
    differs refuses a tile: `local` decodes it here instead (the same bits by construction)."""

    def images(self, tiles: list[torch.Tensor], part: str, call: TileCall, local) -> Iterator[torch.Tensor]:
        """Each tile's output, in the tiles' order (`part`: what decode_tile runs, TILE_PARTS)."""

    def chunks(
        self, tiles: list[torch.Tensor], quality: str, timestep: float | None, call: TileCall, local
    ) -> list[Iterator[torch.Tensor]]:
        """Each video tile's output chunks as they arrive, all tiles started at once."""


@dataclass
class DecodeCall:
    contexts: list[RequestContext]  # the batch's requests', in order
    fingerprint: str
    batch_gone: threading.Event | None = None  # the batcher's: every caller of the batch left
    host_copies: list | None = None  # CUDA events of the copies queued; None: each copy waited for
    spread: TileSpreader | None = None  # decodes a request's tiles on other replicas
    decoded_by: set = field(default_factory=set)  # ids of the replicas its spreader had decode tiles
    running_members: tuple[int, ...] = ()  # the requests of the run being decoded

    @property
    def replicas(self) -> int:
        """Replicas whose decoders worked on this call: this one alone, or those its tiles went to."""
        return max(1, len(self.decoded_by))

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


def checkpoint_hook(module, args) -> None:
    """A forward pre-hook for a decoder: the checkpoint of the call running on this thread, before
    each of its forwards, wherever the model's own `decode` calls it from (none: a decode the
    engine runs for itself, on the meta twin or at start-up)."""
    call = _RUNNING.get()
    if call is not None:
        call.checkpoint()
