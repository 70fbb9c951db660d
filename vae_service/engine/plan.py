"""A batch's decode plan, made by one function before any tensor moves: which requests share a
decoder run, whether a run's items decode together or each alone, and each run's tile grid. The
engine then executes the plan with a `DecodeCall`, the state of that one call; the engine itself
keeps none, so calls from several threads cannot see each other's.

Tiers:
- `preview`: one run for the whole batch (the preview's map is per pixel, never tiled);
- `lossless`: one run per request, every item alone (bit-identity with `vae.decode` of that item);
- `high`: one run for the whole batch when nothing is tiled and the batch fits the bound together,
  else one run per request with its items together, tiled by its grid.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vae_service.engine.errors import DecodeAbandoned
from vae_service.engine.latents import PreparedRequest
from vae_service.engine.tiling import TileGrid
from vae_service.models.diffusers_tiling import DECODER_PARTS


@dataclass(frozen=True)
class Run:
    members: tuple[int, ...]  # indices of the batch's requests decoded by this run, in order
    together: bool  # their items share one decoder call; else every item runs alone
    grid: TileGrid | None = None


@dataclass(frozen=True)
class BatchPlan:
    quality: str
    runs: tuple[Run, ...]
    tiled: bool


class TileSpreader(Protocol):
    """Decodes a request's tiles elsewhere (other replicas: the serving layer's, the engine never
    imports Ray), each tile by `engine.decode_tile` or `engine.tile_chunks` there. Both add the ids
    of the replicas that decoded tiles to `replicas`."""

    def images(self, tiles: list[torch.Tensor], part: str, replicas: set) -> list[torch.Tensor]:
        """Each tile's output, in the tiles' order (`part`: what decode_tile runs, TILE_PARTS)."""

    def chunks(
        self, tiles: list[torch.Tensor], quality: str, timestep: float | None, replicas: set
    ) -> list[Iterator[torch.Tensor]]:
        """Each video tile's output chunks as they arrive, all tiles started at once."""


# what a spread image tile runs: `high`'s decode of the tile, or a job of the model's own tiled
# decode (models/diffusers_tiling.py: the decoder module alone, or a cached causal decoder's tile)
TILE_PARTS = ("high", *DECODER_PARTS)


@dataclass
class DecodeCall:
    """One call's own state: when to stop, and the host copies it queued (CUDA, deferred)."""

    abandoned: threading.Event | None = None
    host_copies: list | None = None  # CUDA events of the copies queued; None: each copy waited for
    spread: TileSpreader | None = None  # decodes a request's tiles on other replicas
    decoded_by: set = field(default_factory=set)  # ids of the replicas its spreader had decode tiles

    @property
    def replicas(self) -> int:
        """Replicas whose decoders worked on this call: this one alone, or those its tiles went to."""
        return max(1, len(self.decoded_by))

    def checkpoint(self) -> None:
        """Runs before every decoder call (an item, a tile, a latent frame, and each call a
        decoder's own `decode` makes: temporal tiles, frame batches): stops the decode once every
        request of it timed out or went away."""
        if self.abandoned is not None and self.abandoned.is_set():
            raise DecodeAbandoned("body", "every request of this decode timed out or went away")

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


def plan_batch(
    batch: list[PreparedRequest],
    grids: list[TileGrid | None],
    peak_bytes: Callable[[PreparedRequest], int],
    bound: int,
) -> BatchPlan:
    """`grids`: each request's tile grid (None: untiled); `bound`: the decode bound of this call."""
    keys = {r.batch_key for r in batch}
    if len(keys) != 1:
        raise ValueError(f"a batch must share one (tier, shape, dtype) key, got {sorted(map(str, keys))}")
    quality = batch[0].request.quality
    tiled = grids[0] is not None
    everyone = tuple(range(len(batch)))
    if quality == "preview":
        runs = (Run(everyone, together=True),)
    elif quality == "lossless":
        runs = tuple(Run((i,), together=False, grid=g) for i, g in enumerate(grids))
    elif not tiled and (len(batch) == 1 or sum(peak_bytes(r) for r in batch) <= bound):
        runs = (Run(everyone, together=True),)
    else:
        runs = tuple(Run((i,), together=True, grid=g) for i, g in enumerate(grids))
    return BatchPlan(quality, runs, tiled)
