"""A replica's sessions leaving it and coming to it, through the deployment's session keeper
(keeper.py):

- drain (`hand_off_all`): when the replica is told to stop, each open session's chunk in flight
  finishes and is answered, then the session takes no more chunks here; its state goes to the keeper
  (host copy off the event loop), and its conversation tells the client `moved`; the client
  reconnects with the session's id and attaches on another replica. A session whose state cannot be
  kept within the drain's time is closed here (its client resumes by replaying, as before);
- checkpoints (`after_chunk`): every `sessions.checkpoint_every_chunks` applied chunks, the session's
  state goes to the keeper in the background, one at a time per session (a slow keeper skips
  checkpoints rather than queueing them); the client keeps only the latents after the latest one.
  A checkpoint outlives the session here when its connection drops or it expires (the client may
  attach to it), until its client closes it or the keeper's time to live passes;
- take-over (`take_over`): a session this replica does not hold is claimed from the keeper and
  continued here (a handoff's state is the session as it was; a checkpoint's is the session some
  chunks back, which the client resends). One take-over per session at a time; a claim that does not
  fit the session budget, or is behind what the client has, is released for another replica.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

from vae_service.engine.execution.session import DecodeSession
from vae_service.engine.request.errors import DecodeError, InvalidInput, Unavailable
from vae_service.engine.request.session import SessionLost, SessionMoved
from vae_service.serving.sessions.keeper import CHECKPOINT, HANDOFF
from vae_service.serving.sessions.registry import SessionRegistry

log = logging.getLogger("ray.serve")
BUSY_POLL_S = 0.01
RETRY_AFTER_S = 1.0
KEPT_REMEMBERED = 65536


class SessionMoves:
    """`keeper`: gives the deployment's keeper actor handle (None: no keeper can be reached: sessions
    neither leave nor come); `owner`: this replica's id."""

    def __init__(self, registry: SessionRegistry, keeper: Callable[[], object | None], owner: Callable[[], str]):
        self.registry, self.keeper, self.owner = registry, keeper, owner
        self._checkpointing: dict[str, asyncio.Task] = {}
        self._taking: dict[str, asyncio.Future] = {}
        # sessions of this replica with a state in the keeper (bounded: the keeper's time to live
        # frees the states of sessions that ended here without their client closing them)
        self._kept: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._draining: asyncio.Task | None = None
        self.handed_off = self.handoffs_failed = self.taken_over = self.checkpoints = 0
        self.checkpoint_failures = 0
        registry.on_applied = self.after_chunk
        registry.on_closed = self.forget

    @property
    def config(self):
        return self.registry.service.config.sessions

    @property
    def draining(self) -> bool:
        return self._draining is not None

    @property
    def ttl_s(self) -> float:
        """How long the keeper holds a state untouched: past the next checkpoint of a session whose
        chunks each come within the idle timeout, and past the idle timeout of one between replicas."""
        return self.config.idle_timeout_s * (self.config.checkpoint_every_chunks + 1)

    # ---- drain --------------------------------------------------------------------------------
    async def hand_off_all(self, timeout_s: float) -> dict:
        """Every open session handed to the keeper within `timeout_s` (each chunk in flight answered
        first); how many left and how many could not. Once per replica: a second call waits for the first."""
        if self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self._hand_off_all(timeout_s))
        return await asyncio.shield(self._draining)

    async def _hand_off_all(self, timeout_s: float) -> dict:
        if not self.config.handoff or not self.registry.open_sessions:
            return {"handed_off": 0, "failed": 0}
        deadline = time.monotonic() + timeout_s
        results = await asyncio.gather(
            *(self._hand_off(sid, deadline) for sid in list(self.registry.open_sessions)), return_exceptions=True
        )
        handed = sum(1 for r in results if r is True)
        self.handed_off += handed
        self.handoffs_failed += len(results) - handed
        return {"handed_off": handed, "failed": len(results) - handed}

    async def _hand_off(self, session_id: str, deadline: float) -> bool:
        registry = self.registry
        session = registry.open_sessions.get(session_id)
        if session is None:
            return False
        while session.busy and time.monotonic() < deadline:  # its chunk in flight is answered first
            await asyncio.sleep(BUSY_POLL_S)
        registry.begin_move(session_id)
        kept = False
        try:
            keeper = self.keeper()
            if keeper is not None and not session.busy:
                await self._cancel_checkpoint(session_id)
                state = await registry.export(session_id)
                call = keeper.keep.remote(session_id, state, state.latent_frames, HANDOFF, None, self.ttl_s)
                kept = await asyncio.wait_for(call, max(0.0, deadline - time.monotonic()))
        except Exception:
            log.exception("handing session %s to the keeper failed: it is closed (its client replays)", session_id)
        registry.left(session_id, bool(kept))
        return bool(kept)

    # ---- checkpoints -------------------------------------------------------------------------------
    def after_chunk(self, session: DecodeSession) -> None:
        every = self.config.checkpoint_every_chunks
        if not every or session.chunks % every or self.draining or self.keeper() is None:
            return
        running = self._checkpointing.get(session.id)
        if running is not None and not running.done():
            return  # the keeper is slower than the chunks: the next checkpoint is taken later
        self._checkpointing[session.id] = asyncio.get_running_loop().create_task(self._checkpoint(session))

    async def _checkpoint(self, session: DecodeSession) -> None:
        registry = self.registry
        try:
            state = await registry.export(session.id)
            self._keeps(session.id)
            kept = await self.keeper().keep.remote(
                session.id, state, state.latent_frames, CHECKPOINT, self.owner(), self.ttl_s
            )
        except KeyError:
            return  # closed meanwhile
        except Exception:
            self.checkpoint_failures += 1
            log.exception("checkpointing session %s failed", session.id)
            return
        finally:
            self._checkpointing.pop(session.id, None)
        if kept and session.id in registry.open_sessions:
            registry.checkpointed[session.id] = max(registry.checkpointed.get(session.id, 0), state.latent_frames)
            self.checkpoints += 1

    async def _cancel_checkpoint(self, session_id: str) -> None:
        running = self._checkpointing.pop(session_id, None)
        if running is not None and not running.done():
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    # ---- coming in ---------------------------------------------------------------------------------
    async def take_over(self, session_id: str, received: int | None = None) -> tuple[DecodeSession, str]:
        """The session continued here from its latest kept state: (the session, HANDOFF or
        CHECKPOINT). `received`: the latent frames the client has (a state past them is refused,
        400 naming `latent_frames`). SessionLost where nothing is kept; SessionMoved where this
        replica drains; Overloaded where it does not fit here; Unavailable where the keeper does not
        answer. Calls for one session at once share one take-over."""
        pending = self._taking.get(session_id)
        if pending is not None:
            session, came_from = await asyncio.shield(pending)
            return session, came_from
        pending = asyncio.get_running_loop().create_future()
        self._taking[session_id] = pending
        try:
            taken = await self._take_over(session_id, received)
            pending.set_result(taken)
            return taken
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                pending.cancel()
            else:
                pending.set_exception(exc)
                pending.exception()  # seen here: an unawaited future must not log it again
            raise
        finally:
            del self._taking[session_id]

    async def _take_over(self, session_id: str, received: int | None) -> tuple[DecodeSession, str]:
        if self.draining:  # reached before Serve stopped routing here: the client tries again
            raise SessionMoved("session", "this replica drains: attach to the session on another one")
        keeper = self.keeper()
        if keeper is None:
            raise SessionLost("session", f"no session {session_id!r} here, and no keeper to continue it from")
        me, wait_s = self.owner(), self.config.open_timeout_s  # a keeper that hangs never holds a caller
        try:
            claimed = await asyncio.wait_for(keeper.claim.remote(session_id, me), wait_s)
            if claimed is None:
                raise SessionLost(
                    "session", f"no session {session_id!r} here, and none kept to continue: resume in a new session"
                )
            (ref,), latent_frames, kind = claimed
            if received is not None and latent_frames > received:
                raise InvalidInput(
                    "latent_frames",
                    f"the session has decoded {latent_frames} latent frames, more than the {received} received: "
                    "open a new session",
                )
            state = await asyncio.wait_for(ref, wait_s)
        except (DecodeError, asyncio.CancelledError):
            _release(keeper, session_id, me)
            raise
        except Exception as exc:  # the keeper, or the object store, did not answer: the client retries
            _release(keeper, session_id, me)
            raise Unavailable(
                "session", f"the session keeper did not answer ({type(exc).__name__}); retry", RETRY_AFTER_S
            ) from None
        try:
            session = self.registry.adopt(state)
        except BaseException:
            _release(keeper, session_id, me)
            raise
        self._keeps(session_id)
        self.taken_over += 1
        return session, kind

    def forget(self, session_id: str) -> None:
        """A session its client closed here needs no state kept."""
        task = self._checkpointing.pop(session_id, None)
        if task is not None:
            task.cancel()
        if self._kept.pop(session_id, 0) is None:
            keeper = self.keeper()
            if keeper is not None:
                keeper.forget.remote(session_id, self.owner())

    def _keeps(self, session_id: str) -> None:
        self._kept[session_id] = None
        while len(self._kept) > KEPT_REMEMBERED:
            self._kept.popitem(last=False)

    def describe(self) -> dict:
        return {
            "handed_off": self.handed_off,
            "handoffs_failed": self.handoffs_failed,
            "taken_over": self.taken_over,
            "checkpoints": self.checkpoints,
            "checkpoint_failures": self.checkpoint_failures,
        }


def _release(keeper, session_id: str, claimant: str) -> None:
    """Give a claim back (the keeper may be what failed: then its time to live frees it)."""
    with contextlib.suppress(Exception):
        keeper.release.remote(session_id, claimant)
