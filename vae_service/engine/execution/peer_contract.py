"""The contract between a request's tiles and the deployment's other replicas: what a replica is
told of the call (TileCall), what it answers about a tile it was offered (serving/scheduling/tile_surface.py
answers, serving/scheduling/tile_peers.py carries), and the transport's shape (TilePeers, RemoteTile). The
executors (tile_executor.py) and the call's state (call.py) both read it; it reads neither."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from vae_service.engine.request.context import RequestContext
from vae_service.engine.runtime.tile_jobs import TileJob


@dataclass
class TileCall:
    """What decoding a request's tiles on other replicas needs of it: its context (deadline,
    abandonment), the fingerprint a replica must have to decode them, and where to note which
    replicas (other than this one) did."""

    context: RequestContext
    fingerprint: str
    replicas: set = field(default_factory=set)


# ---- what a replica answers about a tile it was offered (serving/scheduling/tile_peers.py) ---------------
@dataclass(frozen=True)
class Accepted:
    replica: str


@dataclass(frozen=True)
class Chunk:
    pixels: torch.Tensor


@dataclass(frozen=True)
class End:
    chunks: int  # how many it sent: fewer read means the stream ended short


@dataclass(frozen=True)
class OfferRefused:
    """The replica did not take the tile, and why (the transport raises TileRefused for it)."""

    reason: str


@dataclass(frozen=True)
class Lost:
    """The replica took the tile and could not finish it (out of memory): TileLost."""

    reason: str


class TileRefused(Exception):
    """The replica did not take the tile (no free slot, another fingerprint, no time left, over its
    own bound): it is decoded here."""


class TileLost(Exception):
    """The replica went away, was overloaded, or the stream ended short: the tile is decoded once more."""


class TileBug(RuntimeError):
    """A replica failed a tile for a reason that is not the request's nor the deployment's (a bug):
    the request answers 500, the replica's log has the traceback."""


class NotShared(Exception):
    """An optional tiling found no replica to share it with: the request decodes whole."""


class RemoteTile(Protocol):
    def poll(self, timeout_s: float) -> Accepted | Chunk | End | None:
        """The next message within `timeout_s` (None: none yet); raises TileRefused, TileLost, or
        anything else for a bug."""

    def cancel(self) -> None:
        """Stop it there (a no-op once ended)."""


class TilePeers(Protocol):
    retry_after_s: float  # what a request that lost a tile twice is told to wait

    def offer(self, job: TileJob, call: TileCall) -> RemoteTile:
        """Send `job` to a replica of the deployment (it answers Accepted, or refuses)."""
