"""The session keeper: where a decode session's state waits between replicas, and who holds it now.

One small Ray actor per decode deployment (named after it, detached, on the head node: it must
outlive every replica and every worker node it keeps states for). A replica that drains puts each
open session's state here (`handoff`) before it stops; every replica puts a checkpoint here every
`sessions.checkpoint_every_chunks` chunks. The replica a client comes back to claims the latest state
and becomes the session's owner, which the request router asks for a session whose first owner (the
replica its id names) is gone. Its states live in the head node's object store (put by the keeper
itself: the replica's own copy goes with its node).

`SessionShelf` is the keeper's logic, Ray-free: one entry per session, the newest state wins (a
checkpoint that arrives after a newer handoff never replaces it), entries idle past their time to
live (the session's idle timeout: it would have expired anyway) are dropped, and an owner forgets
only its own entries (a replica freeing a session that moved on must not erase the new owner's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vae_service.serving.scheduling.session_router import KEEPER_NAMESPACE, keeper_name

HANDOFF, CHECKPOINT = "handoff", "checkpoint"
MAX_KEPT = 100_000  # sessions with a state kept at once: far past what a deployment's replicas hold
MAX_BYTES = 64 * 2**30  # states' bytes kept at once (the head's object store spills past its memory)


@dataclass
class Kept:
    state: Any  # the SessionState (in the actor: a reference to it in the head's object store)
    latent_frames: int
    kind: str
    owner: str | None  # the replica holding the session live now; None while it is between replicas
    ttl_s: float
    touched: float
    nbytes: int


class SessionShelf:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, max_kept: int = MAX_KEPT, max_bytes: int = MAX_BYTES
    ):
        self.clock, self.max_kept, self.max_bytes = clock, max_kept, max_bytes
        self.entries: dict[str, Kept] = {}
        self.aliases: dict[str, str] = {}  # a watched session's watch id -> its id (viewers' relays are routed by it)
        self.handoffs = self.checkpoints = self.claims = 0

    def keep(
        self,
        session_id: str,
        state: Any,
        latent_frames: int,
        kind: str,
        owner: str | None,
        ttl_s: float,
        nbytes: int,
        alias: str | None = None,
    ) -> bool:
        """True if kept: an older state than the one kept already is dropped. `alias`: another id
        the session is asked about by (a watched session's watch id)."""
        self._sweep()
        now, kept = self.clock(), self.entries.get(session_id)
        if kept is not None and latent_frames < kept.latent_frames:
            return False
        if kept is None and len(self.entries) >= self.max_kept:
            return False
        if self.bytes() - (kept.nbytes if kept else 0) + nbytes > self.max_bytes:
            return False  # the head's object store is not the place for more: a crash costs a replay
        if kept is not None and kind == CHECKPOINT and kept.owner not in (None, owner):
            return False  # a checkpoint from a replica the session has left since
        self.entries[session_id] = Kept(state, latent_frames, kind, owner, ttl_s, now, nbytes)
        if alias is not None:
            self.aliases[alias] = session_id
        if kind == HANDOFF:
            self.handoffs += 1
        else:
            self.checkpoints += 1
        return True

    def claim(self, session_id: str, claimant: str) -> Kept | None:
        """The session's latest state, now owned by `claimant` (the last claim wins: a client comes
        back to one replica at a time); None where nothing is kept."""
        self._sweep()
        kept = self.entries.get(session_id)
        if kept is None:
            return None
        claimed = replace(kept)  # as it was kept: a handoff's state is the session as it left
        # from now it is where the session was when `claimant` took it: should the claimant be lost
        # before its first checkpoint, the next one resumes from it as from a checkpoint
        kept.owner, kept.touched, kept.kind = claimant, self.clock(), CHECKPOINT
        self.claims += 1
        return claimed

    def release(self, session_id: str, claimant: str) -> None:
        """A claimant that could not take the session in (no room) leaves it between replicas."""
        kept = self.entries.get(session_id)
        if kept is not None and kept.owner == claimant:
            kept.owner = None

    def owner_of(self, session_id: str) -> str | None:
        """The replica holding the session now (asked by its id or an alias of it)."""
        kept = self.entries.get(self.aliases.get(session_id, session_id))
        return None if kept is None else kept.owner

    def forget(self, session_id: str, owner: str) -> None:
        kept = self.entries.get(session_id)
        if kept is not None and kept.owner in (owner, None):
            del self.entries[session_id]
            self._drop_aliases()

    def _sweep(self) -> None:
        now = self.clock()
        for session_id in [s for s, k in self.entries.items() if now - k.touched > k.ttl_s]:
            del self.entries[session_id]
        self._drop_aliases()

    def _drop_aliases(self) -> None:
        """Those naming a session no longer kept (as the sweep, one pass over what is kept)."""
        self.aliases = {a: s for a, s in self.aliases.items() if s in self.entries}

    def bytes(self) -> int:
        return sum(k.nbytes for k in self.entries.values())

    def describe(self) -> dict:
        return {
            "sessions": len(self.entries),
            "bytes": self.bytes(),
            "handoffs": self.handoffs,
            "checkpoints": self.checkpoints,
            "claims": self.claims,
        }


class SessionKeeper:
    """The actor around a SessionShelf; its states put in the object store here, on the head node."""

    def __init__(self):
        self.shelf = SessionShelf()

    def keep(self, session_id: str, state, latent_frames: int, kind: str, owner: str | None, ttl_s: float) -> bool:
        import ray

        alias = dict(state.delivery).get("watch_id")
        return self.shelf.keep(session_id, ray.put(state), latent_frames, kind, owner, ttl_s, state.nbytes, alias)

    def claim(self, session_id: str, claimant: str) -> tuple | None:
        """(a reference to the state, its latent frames, its kind), or None."""
        kept = self.shelf.claim(session_id, claimant)
        return None if kept is None else ([kept.state], kept.latent_frames, kept.kind)

    def release(self, session_id: str, claimant: str) -> None:
        self.shelf.release(session_id, claimant)

    def owner_of(self, session_id: str) -> str | None:
        return self.shelf.owner_of(session_id)

    def forget(self, session_id: str, owner: str) -> None:
        self.shelf.forget(session_id, owner)

    def describe(self) -> dict:
        return self.shelf.describe()


def keeper_handle(app: str, deployment: str):
    """The deployment's keeper, started by the first replica that asks."""
    import ray

    actor = ray.remote(SessionKeeper).options(
        name=keeper_name(app, deployment),
        namespace=KEEPER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},  # outlives every worker node
        max_restarts=-1,
    )
    return actor.remote()
