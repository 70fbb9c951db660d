"""What limits a replica, as the floats Serve's custom autoscaling policy reads back
(serving/autoscaling_policy.py; docs/autoscaling.md). Serve calls `load_report` through the
replica's `record_autoscaling_stats` every few seconds, on the replica's event loop, and averages
each figure over `look_back_period_s`: each report covers the period since the previous one.

- `device_busy`: the fraction of that period the device ran steps (0..1).
- `realtime_wait_ms`, `interactive_wait_ms`: the class's queue wait, p90 of the batches started in
  the period, or the oldest request still queued if it has waited longer (a device that keeps a
  class waiting starts none of its batches: their waits would show only once it stops).
- `session_room`: open sessions' priced bytes over the session budget (0..1 and over). An open
  session holds device memory whether it sends or not; a connection without a session holds none.
- `bulk_backlog_s`: queued bulk items times the device seconds a recent item took: work, not count.
- `session_slots`: the tighter of the replica's session caps in use: open sessions over
  `limits.max_sessions`, connections over its session connections (0..1). Never a reason to add a
  replica (an idle socket is no load), but the floor of a scale-down: the sessions of a replica
  that goes must find a place on the rest.
- counts beside them (sessions, connections, queued items per class) for dashboards and the bench.

Cheap: a pass over at most RECENT_WAITS waits per class and the queues' heads; no tensor, no lock
but the device turns' own reads. Imports nothing of the sessions or above (`service` is read by
attribute: a DecodeService)."""

from __future__ import annotations

import weakref

from vae_service.names import PRIORITIES
from vae_service.serving.scheduling.classes import BULK, INTERACTIVE, REALTIME
from vae_service.serving.scheduling.wait_stats import quantile

WAIT_QUANTILE = 0.9  # a tail that needs a tenth of a period's batches late: not one slow step

# per device (a scheduler's turns): (the scheduler's clock, the device's busy seconds) at the previous report
_previous: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_report(service) -> dict[str, float]:
    scheduler, sessions = service.scheduler, service.sessions
    turns, now = scheduler.turns, scheduler.clock()
    busy_s = turns.busy_seconds()
    since, busy_before = _previous.get(turns, (turns.since, 0.0))
    _previous[turns] = (now, busy_s)
    period_s = now - since
    report = {
        "device_busy": _clamped((busy_s - busy_before) / period_s) if period_s > 0 else 0.0,
        "realtime_wait_ms": _wait_ms(scheduler, REALTIME, since),
        "interactive_wait_ms": _wait_ms(scheduler, INTERACTIVE, since),
        "session_room": _room(sessions.held_bytes, sessions.budget()),
        "bulk_backlog_s": _bulk_backlog_s(scheduler),
        "session_slots": _slots(sessions, service.config),
        "sessions_open": float(len(sessions.open_sessions)),
        "connections": float(sessions.connections),
        "started_batches": float(scheduler.running),
    }
    for priority in PRIORITIES:
        report[f"{priority}_queued"] = float(scheduler.queued_items(priority))
    return report


def _wait_ms(scheduler, priority: str, since: float) -> float:
    started = quantile(scheduler.stats.waits_since(priority, since), WAIT_QUANTILE) or 0.0
    return 1e3 * max(started, scheduler.oldest_wait_s(priority))


def _slots(sessions, config) -> float:
    used = [
        (len(sessions.open_sessions), config.limits.max_sessions),
        (sessions.connections, config.session_connections),
    ]
    return max((n / cap if cap > 0 else float(n > 0)) for n, cap in used)


def _room(held: int, budget: int) -> float:
    if budget <= 0:  # no room for sessions at all: any held is full, none is empty
        return 1.0 if held else 0.0
    return held / budget


def _bulk_backlog_s(scheduler) -> float:
    """Queued bulk work in device seconds. Priced by bulk's own recent items, else by any class's
    (the same decoder: better than nothing), else 0 until a first batch ran (seconds away)."""
    queued = scheduler.queued_items(BULK)
    if not queued:
        return 0.0
    stats = scheduler.stats
    per_item = stats.seconds_per_item(BULK) or max((stats.seconds_per_item(c) or 0.0 for c in PRIORITIES), default=0.0)
    return queued * per_item


def _clamped(fraction: float) -> float:
    return min(1.0, max(0.0, fraction))
