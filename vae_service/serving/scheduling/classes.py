"""The scheduler's priority classes (names.PRIORITIES, most urgent first) and what a caller may
claim: a request or session asks for a class in `priority`; the deployment's config names the most
urgent class each kind of caller may claim, so no caller starves the others by asking. Claiming a
less urgent class is always allowed (a batch job that yields to live work)."""

from __future__ import annotations

from vae_service.config import Scheduling
from vae_service.engine.request.errors import InvalidInput
from vae_service.names import PRIORITIES

REALTIME, INTERACTIVE, BULK = PRIORITIES
RANK = {name: rank for rank, name in enumerate(PRIORITIES)}  # 0: the most urgent


def request_class(priority: str | None, scheduling: Scheduling) -> str:
    """A request's class: its claim, or `interactive` (never above what requests may claim)."""
    return _claimed(priority, INTERACTIVE, scheduling.requests_highest_class, "requests", "scheduling.requests")


def session_class(priority: str | None, scheduling: Scheduling) -> str:
    """A session's chunks' class: its claim at open, or `realtime` (never above what sessions may claim)."""
    return _claimed(priority, REALTIME, scheduling.sessions_highest_class, "sessions", "scheduling.sessions")


def _claimed(priority: str | None, default: str, highest: str, who: str, setting: str) -> str:
    if priority is None:
        return max(default, highest, key=RANK.__getitem__)
    if RANK[priority] < RANK[highest]:
        raise InvalidInput(
            "priority",
            f"{who} on this deployment may claim {highest!r} or a less urgent class "
            f"({list(PRIORITIES[RANK[highest] :])}), not {priority!r} ({setting}_highest_class)",
        )
    return priority


def promoted(priority: str, waited_s: float, promote_after_s: float) -> str:
    """The class a decode is scheduled as after waiting `waited_s`: one class more urgent for each
    `promote_after_s` waited (queued or suspended), so work of any class finishes."""
    return PRIORITIES[max(0, RANK[priority] - int(waited_s // promote_after_s))]
