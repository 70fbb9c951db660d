"""The decoder's autoscaling policy (docs/autoscaling.md): replicas for what limits a decoder, not
for ongoing requests. Each replica reports what limits it (serving/scheduling/load_report.py); Serve
averages each figure over `look_back_period_s` and this policy reads them back per replica.

- Up, when a latency class waits past its target (realtime, interactive: the mean over replicas of
  their p90 waits; proportionally, at most `max_wait_step` times the replicas at once: a queue's wait
  grows without bound as its device saturates, so its ratio overstates the replicas needed), when the
  open sessions' room summed needs more replicas at `session_room` each, or when the queued bulk
  work summed needs more replicas at `bulk_backlog_s` each.
- Down, to the fewest replicas that hold the work under target (the device busy fractions summed at
  `target_device_busy` each, session room and bulk backlog as above), never while any replica's
  latency class waits past its target, and never while a running replica has not reported yet
  (present, its load unknown: missing data never scales down). Never to zero while Serve counts a
  request in flight (an open socket is one: scaling to zero would cut it).
- A connection's socket is never load: only its session's priced bytes count, through session_room.
  The session caps in use (`session_slots`: open sessions and connections over their caps) are a
  floor for a scale-down only: the sessions of a replica that goes move to the rest.

Serve wraps a custom policy (ray.serve.autoscaling_policy._apply_autoscaling_config): it applies
`upscale_delay_s`, `downscale_delay_s` (a direction must be asked for without a break for that long),
the up/downscaling factors and min/max. So this policy only says how many replicas the load needs;
it bounds its answer by the capacity-adjusted min/max itself so that the delays compare bounded
counts.

Serve pickles this module by value and runs it in its controller: the standard library only (tested).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # never at run time: the controller unpickles this module without importing ray here
    from ray.serve.config import AutoscalingContext

# what load_report.py reports, per replica
BUSY, ROOM, BACKLOG, SLOTS = "device_busy", "session_room", "bulk_backlog_s", "session_slots"
WAITS = {"realtime": "realtime_wait_ms", "interactive": "interactive_wait_ms"}
METRICS = (BUSY, ROOM, BACKLOG, *WAITS.values())


class DecoderScalingPolicy:
    """Serve instantiates it once with `policy_kwargs` and calls it every control loop tick.

    Defaults suit a GPU replica (one decoder on one device):
    - target_device_busy 0.7: scale down only to replicas that would each run steps at most 70% of
      the time: the rest absorbs a burst while a new GPU replica starts (tens of seconds).
    - realtime_wait_ms 50: a session's chunk is a few hundred ms of video at the player's rate (a
      Wan latent frame: 4 frames, 250 ms at 16 fps); the queue may take a fifth of it.
    - interactive_wait_ms 250: about one large image's decode on a GPU; waiting longer than that
      doubles what a caller sees.
    - session_room 0.8: sessions are sticky and a new replica takes tens of seconds: a fifth of the
      session budget stays free for sessions opening meanwhile.
    - bulk_backlog_s 60: bulk work is throughput: a minute of queued device work per replica drains
      on its own; a new GPU replica for less would spend its start-up on work nearly done.
    - max_wait_step 2: at most double the replicas on one wait signal.
    """

    def __init__(
        self,
        target_device_busy: float = 0.7,
        realtime_wait_ms: float = 50.0,
        interactive_wait_ms: float = 250.0,
        session_room: float = 0.8,
        bulk_backlog_s: float = 60.0,
        max_wait_step: float = 2.0,
    ):
        targets = {
            "target_device_busy": target_device_busy,
            "realtime_wait_ms": realtime_wait_ms,
            "interactive_wait_ms": interactive_wait_ms,
            "session_room": session_room,
            "bulk_backlog_s": bulk_backlog_s,
        }
        for name, value in targets.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, not {value!r}")
        if not max_wait_step > 1:
            raise ValueError(f"max_wait_step must be more than 1, not {max_wait_step!r}")
        self.target_device_busy, self.session_room, self.bulk_backlog_s = (
            target_device_busy,
            session_room,
            bulk_backlog_s,
        )
        self.wait_targets_ms = {"realtime": realtime_wait_ms, "interactive": interactive_wait_ms}
        self.max_wait_step = max_wait_step

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        replicas, why = self.decide(ctx)
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        bounded = max(low, min(high, replicas))
        return bounded, {**ctx.policy_state, "decoder": {**why, "wanted": replicas, "replicas": bounded}}

    def decide(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        """(replicas the load needs, why) before bounds."""
        running, target = ctx.current_num_replicas, ctx.target_num_replicas
        if running == 0:  # nothing reports: Serve's cold start scales up on queued requests
            return target, {"reason": "hold: no replica running"}
        loads = known_loads(ctx)
        why: dict = {"known": len(loads), "unknown": running - len(loads)}
        if loads:
            why.update({name: sum(load[name] for load in loads.values()) for name in (BUSY, ROOM, BACKLOG)})
            why.update({WAITS[c]: _mean(load[WAITS[c]] for load in loads.values()) for c in WAITS})
        else:
            why.update(dict.fromkeys((BUSY, ROOM, BACKLOG), 0.0))
        held = max(_replicas_for(why[ROOM], self.session_room), _replicas_for(why[BACKLOG], self.bulk_backlog_s))
        up, late = held, []
        for cls, target_ms in self.wait_targets_ms.items():
            waits = [load[WAITS[cls]] for load in loads.values()]
            if waits and max(waits) > target_ms:
                late.append(cls)
            ratio = (_mean(waits) / target_ms) if waits else 0.0
            if ratio > 1:  # on the replicas that reported: an unknown one may be the capacity already added
                up = max(up, math.ceil(len(loads) * min(ratio, self.max_wait_step)))
        if up > target:
            return up, {**why, "reason": "up: " + _pressure(up, held, late)}
        if late or why["unknown"]:
            return target, {**why, "reason": f"hold: {'late ' + ', '.join(late) if late else 'replicas not reported'}"}
        in_flight = 1 if ctx.total_num_requests > 0 else 0
        # where the sessions and connections there are fit (never a reason to add a replica: a
        # socket is no load; but a replica that goes must leave room for its sessions to move to)
        slots = _replicas_for(sum(_slots(ctx, replica) for replica in loads), 1.0)
        needed = max(held, _replicas_for(why[BUSY], self.target_device_busy), in_flight, slots)
        if needed < target:
            return needed, {**why, "reason": "down: the work fits fewer replicas under target"}
        return target, {**why, "reason": "hold: within targets"}


def known_loads(ctx: AutoscalingContext) -> dict:
    """Per running replica that reported every figure: {name: value}. A replica missing one (just
    started, or its report failed) is unknown: present, its load not counted."""
    metrics = ctx.aggregated_metrics or {}
    loads = {}
    for replica in ctx.running_replicas:
        values = {name: metrics.get(name, {}).get(replica) for name in METRICS}
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in values.values()):
            loads[replica] = values
    return loads


def _slots(ctx: AutoscalingContext, replica) -> float:
    """A replica's session caps in use (0 where it did not say: an older replica's report)."""
    value = (ctx.aggregated_metrics or {}).get(SLOTS, {}).get(replica, 0.0)
    return value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _replicas_for(total: float, per_replica: float) -> int:
    # a sum of floats a hair over a whole number of targets is that number (0.7 * 3 summed is 2.1000000000000005)
    return max(0, math.ceil(total / per_replica - 1e-9))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _pressure(up: int, held: int, late: list[str]) -> str:
    return f"{', '.join(late)} waits past target" if up > held and late else "session room or bulk backlog"
