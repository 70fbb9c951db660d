"""Serve's request router for decode deployments, by class: a session's calls go to the replica
that holds it (serving/scheduling/session_router.py); a new session or a `realtime` request to the
replica with the least realtime work waiting or started there (its chunks then wait behind the
fewest); a `bulk` request to where it hurts least: the replica with the least work of any class (it
runs in the gaps urgent work leaves, so a busy replica's urgent work would preempt it over and over,
each time holding its state). `interactive` calls (requests by default, and other replicas' tile
offers) go as Serve routes them by default (power of two choices on live queue lengths): the
replicas' work per class is up to a second old, and a burst of ordinary requests ranked on it
would all go to the replica that looked idlest (a tile offered to the deployment would even come
back to its own, busy, requester).

What each replica has: its scheduler's latent items queued or started, per class, reported through
the deployment's `record_routing_stats` (Serve polls it every `request_routing_stats_period_s`:
ROUTING_STATS_PERIOD_S here). A request's class is what the router can see before any body byte: a
handle call's `priority` keyword, a session's open (gRPC DecodeSession, a handle's `open_session`:
realtime), else its surface's default (interactive); a class claimed inside a
body is honoured by the replica's scheduler, not here. Replicas that have not reported yet (just
started) and ties are left to Serve's default (power of two choices, locality)."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RunningReplica

from vae_service.names import PRIORITIES
from vae_service.serving.scheduling.classes import BULK, INTERACTIVE, RANK, REALTIME
from vae_service.serving.scheduling.session_router import SessionAffinityRouter, session_owner

ROUTER_PATH = "vae_service.serving.scheduling.class_router.ClassAwareRouter"
ROUTING_STATS_PERIOD_S = 1.0
# a handle's and a gRPC stream's session opens; a WebSocket's is routed as any HTTP call (Serve 2.60
# gives a WebSocket scope no route name)
SESSION_OPENS = ("open_session", "DecodeSession")


def request_class(pending: PendingRequest | None) -> str:
    """The class the router sees for a call: its `priority` keyword, a session's open, or interactive."""
    if pending is None:
        return INTERACTIVE
    claimed = pending.kwargs.get("priority")
    if isinstance(claimed, str) and claimed in PRIORITIES:
        return claimed
    metadata = pending.metadata
    if metadata.call_method in SESSION_OPENS:
        return REALTIME
    if (metadata._grpc_service_method or "").endswith("/DecodeSession"):
        return REALTIME
    return INTERACTIVE


def work_key(stats: dict, priority: str) -> tuple[int, int]:
    """How much an arriving request of `priority` would wait behind on a replica (smaller first):
    urgent classes count the work at least as urgent as theirs, bulk all of it."""
    items = stats.get("items", {})
    ahead = sum(items.get(c, 0) for c in PRIORITIES if RANK[c] <= RANK[priority])
    total = sum(items.get(c, 0) for c in PRIORITIES)
    return (total, ahead) if priority == BULK else (ahead, total)


def ranked(replicas: list[RunningReplica], priority: str) -> list[list[RunningReplica]] | None:
    """Replicas in order of the work `priority` would wait behind, one rank each; None when some
    have not reported (Serve's default then)."""
    if any(not isinstance(r.routing_stats, dict) or "items" not in r.routing_stats for r in replicas):
        return None
    keys = {r.replica_id.unique_id: work_key(r.routing_stats, priority) for r in replicas}
    order = sorted(replicas, key=lambda r: keys[r.replica_id.unique_id])
    if len({keys[r.replica_id.unique_id] for r in order}) == 1:
        return None  # all alike: locality and queue lengths decide
    return [[r] for r in order]


class ClassAwareRouter(SessionAffinityRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        priority = request_class(pending_request)
        if session_owner(pending_request) is None and priority != INTERACTIVE and len(candidate_replicas) > 1:
            ranks = ranked(candidate_replicas, priority)
            if ranks is not None:
                return ranks
        return await super().choose_replicas(candidate_replicas, pending_request)
