"""Serve's request router for decode deployments: a decode session's calls go to the replica that
holds it; every other request is routed as Serve routes it by default (power of two choices,
locality, multiplexing).

A session's id begins with the unique id of the replica that opened it (serving/sessions/registry.py),
and its calls carry it in Serve's own `session_id` handle option (`handle.options(session_id=sid)`,
"session stickiness" in Serve's API, which the default router does not act on; the HTTP proxy sets
it from an `x-session-id` header, the gRPC proxy from `session_id` metadata) or as the `session`
keyword. The router picks exactly that replica while it is running. Once it is gone (it drained and
handed the session on, or it was lost), the router asks the deployment's session keeper
(serving/sessions/keeper.py) which replica holds the session now, and remembers the answer; where
none does yet (the session waits in the keeper between replicas), any replica answers and takes it
over. Model multiplexing was the other candidate: it prefers replicas that loaded a model id but
sends a call elsewhere when those are busy, which for a session would mean a replica without its
cache (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

log = logging.getLogger("ray.serve")
KEEPER_NAMESPACE = "vae-service"
OWNERS_REMEMBERED = 4096
KEEPER_LOOKUP_S = 5.0
KEEPER_ANSWER_S = 2.0  # a keeper slower than this: the call is routed as any call (it takes over there)


def keeper_name(app: str, deployment: str) -> str:
    """The name of a decode deployment's session keeper actor (in KEEPER_NAMESPACE)."""
    return f"sessions:{app}:{deployment}"


def session_of(pending: PendingRequest | None) -> str | None:
    """The session a call belongs to (None: not a session's call)."""
    if pending is None:
        return None
    session = pending.metadata.session_id or pending.kwargs.get("session")
    return session if isinstance(session, str) and "." in session else None


def session_owner(pending: PendingRequest | None) -> str | None:
    """The replica id a session call names (None: not a session's call)."""
    session = session_of(pending)
    return None if session is None else session.split(".", 1)[0]


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session = session_of(pending_request)
        if session is not None:
            by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
            for owner in (session.split(".", 1)[0], await self._moved_owner(session, by_id)):
                if owner in by_id:
                    return [[by_id[owner]]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    async def _moved_owner(self, session: str, running: dict) -> str | None:
        """The replica holding a session that left its first one: remembered, else the keeper's
        answer (None: it holds none, or no keeper can be reached)."""
        owners = self.__dict__.setdefault("_session_owners", collections.OrderedDict())
        if session.split(".", 1)[0] in running:
            return None
        known = owners.get(session)
        if known in running:
            return known
        keeper = self._session_keeper()
        if keeper is None:
            return None
        try:
            owner = await asyncio.wait_for(keeper.owner_of.remote(session), KEEPER_ANSWER_S)
        except Exception as exc:
            log.warning("the session keeper did not answer (%s): session %s routed as any call", exc, session)
            return None
        if owner is not None:
            owners[session] = owner
            while len(owners) > OWNERS_REMEMBERED:
                owners.popitem(last=False)
        return owner

    def _session_keeper(self):
        """The deployment's keeper; None while there is none (looked up again at most every
        KEEPER_LOOKUP_S: a blocking call on the router's loop)."""
        if self.__dict__.get("_keeper") is None and time.monotonic() >= self.__dict__.get("_keeper_next", 0.0):
            import ray

            deployment = self._deployment_id
            self._keeper_next = time.monotonic() + KEEPER_LOOKUP_S
            try:
                self._keeper = ray.get_actor(keeper_name(deployment.app_name, deployment.name), KEEPER_NAMESPACE)
            except Exception:  # none yet: no session has left a replica
                return None
        return self.__dict__.get("_keeper")
