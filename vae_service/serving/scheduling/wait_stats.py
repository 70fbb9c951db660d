"""What the scheduler did, per class, for /health: queue waits (p50/p99 of the recent ones), batches
and steps run, preemptions, promotions, refusals of a full class queue, and starts that waited
because suspended work left no room. For the autoscaling report (load_report.py): the waits of a
recent period, each timed, and the device seconds a recent item of the class took."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vae_service.names import PRIORITIES

RECENT_WAITS = 1024
RECENT_BATCHES = 32  # enough batches to price an item by, few enough to follow a change of work


@dataclass
class _Class:
    waits: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_WAITS))  # (at, s)
    costs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_BATCHES))  # (s, items)
    batches: int = 0
    steps: int = 0
    preemptions: int = 0
    promotions: int = 0
    refused: int = 0
    waited_for_room: int = 0
    preempted_s: float = 0.0
    longest_step_s: float = 0.0  # what a more urgent decode may wait for at most, as seen

    def describe(self) -> dict:
        waits = sorted(w for _, w in self.waits)
        return {
            "queue_wait_ms_p50": _ms(quantile(waits, 0.5)),
            "queue_wait_ms_p99": _ms(quantile(waits, 0.99)),
            "batches": self.batches,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "promotions": self.promotions,
            "refused": self.refused,
            "waited_for_room": self.waited_for_room,
            "preempted_ms": round(self.preempted_s * 1e3, 3),
            "longest_step_ms": round(self.longest_step_s * 1e3, 3),
        }


class ClassStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.classes = {name: _Class() for name in PRIORITIES}

    def refused(self, priority: str) -> None:
        self.classes[priority].refused += 1

    def waited_for_room(self, priority: str) -> None:
        self.classes[priority].waited_for_room += 1

    def started(self, priority: str, waits_s: list[float]) -> None:
        c = self.classes[priority]
        c.batches += 1
        now = self.clock()
        c.waits.extend((now, w) for w in waits_s)

    def finished(self, priority: str, turn, promotions: int, items: int = 1) -> None:
        c = self.classes[priority]
        if turn.ran:
            c.costs.append((turn.held_s, items))
        c.steps += turn.steps + 1 if turn.ran else 0  # the boundaries seen, and the step after the last
        c.preemptions += turn.preemptions
        c.preempted_s += turn.suspended_s
        c.promotions += promotions
        c.longest_step_s = max(c.longest_step_s, turn.longest_step_s)

    def describe(self) -> dict:
        return {name: c.describe() for name, c in self.classes.items()}

    def waits_since(self, priority: str, since: float) -> list[float]:
        """Queue waits (s) of the class's batches started at `since` (the scheduler's clock) or
        later, sorted; at most the last RECENT_WAITS."""
        return sorted(w for at, w in self.classes[priority].waits if at >= since)

    def seconds_per_item(self, priority: str) -> float | None:
        """Device seconds (steps run, not suspended) per item over the class's recent batches;
        None before one has run."""
        costs = self.classes[priority].costs
        items = sum(n for _, n in costs)
        return sum(s for s, _ in costs) / items if items else None


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank); None for none."""
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
