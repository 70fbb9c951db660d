"""When Serve starts to stop this replica (a scale-down, a rolling update, a delete), before it waits
for the replica's ongoing requests to end.

A live decode session's connection (a WebSocket, a gRPC DecodeSession call) is one of those ongoing
requests for its whole life, so the replica's destructor, which Serve calls only after they ended,
comes too late to hand the sessions on: they must be handed on as the drain begins, which ends
their connections. Serve 2.60 has no public hook for that moment; its replica sets
`_shutting_down` ("may be used by replica subclass implementations") on the object whose closure
Serve's replica context keeps (`_handle_registration_callback`). `shutting_down()` reads it there,
and is None where it cannot be found (outside a replica, or another Serve version): sessions are
then handed on from the destructor only, which a session's connection keeps waiting until Serve's
graceful_shutdown_timeout_s (tests/integration/test_session_handoff.py fails on such a version)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("ray.serve")
POLL_S = 0.05


def in_a_replica() -> bool:
    try:
        from ray.serve.context import _get_internal_replica_context

        return _get_internal_replica_context() is not None
    except Exception:
        return False


def shutting_down() -> Callable[[], bool] | None:
    try:
        from ray.serve.context import _get_internal_replica_context

        context = _get_internal_replica_context()
        callback = context._handle_registration_callback if context is not None else None
    except Exception:
        return None
    for cell in getattr(callback, "__closure__", None) or ():
        replica = cell.cell_contents
        if hasattr(replica, "_shutting_down"):
            return lambda: bool(replica._shutting_down)
    return None


class DrainWatch:
    """Runs `on_drain` once, as soon as the replica is told to stop (polled every POLL_S while the
    replica holds sessions)."""

    def __init__(self, on_drain: Callable[[], Awaitable[None]]):
        self.on_drain, self._task, self._flag = on_drain, None, shutting_down()
        if self._flag is None and in_a_replica():
            log.warning("this Serve version does not show when a drain begins: sessions are handed on at shutdown")

    def ensure_running(self) -> None:
        if self._flag is not None and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self._flag():
            await asyncio.sleep(POLL_S)
        await self.on_drain()
