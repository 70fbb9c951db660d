"""Serve's request router for decode deployments: a decode session's calls go to the replica that
holds its causal cache; every other request is routed as Serve routes it by default (power of two
choices, locality, multiplexing).

A session's id begins with its replica's unique id (serving/sessions/registry.py), and its calls carry it in
Serve's own `session_id` handle option (`handle.options(session_id=sid)`, "session stickiness" in
Serve's API, which the default router does not act on) or as the `session` keyword. The router picks
exactly that replica while it is running; when it is gone, any replica answers, and that one knows
no such session: `session_lost`, which the client resumes from. Model multiplexing was the other
candidate: it prefers replicas that loaded a model id but sends a call elsewhere when those are busy,
which for a session would mean a replica without its cache (docs/architecture.md).
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica


def session_owner(pending: PendingRequest | None) -> str | None:
    """The replica id a session call must reach (None: not a session's call)."""
    if pending is None:
        return None
    session = pending.metadata.session_id or pending.kwargs.get("session")
    if not isinstance(session, str) or "." not in session:
        return None
    return session.split(".", 1)[0]


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        owner = session_owner(pending_request)
        if owner is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == owner:
                    return [[replica]]
        return await super().choose_replicas(candidate_replicas, pending_request)
