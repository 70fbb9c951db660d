"""The decoder's autoscaling policy (vae_service/serving/autoscaling_policy.py) on real Serve
AutoscalingContext objects, without a cluster: up on late latency classes, session room and bulk
backlog; down to what the work needs; hold on missing data and late classes; idle sockets are no
load; bounds; and the delays, which Serve itself applies to a custom policy (its own wrapper,
`_apply_autoscaling_config`, run here as the controller runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.constants import SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY
from ray.serve.autoscaling_policy import _apply_autoscaling_config, replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from vae_service.serving.autoscaling_policy import DecoderScalingPolicy

REPO = Path(__file__).resolve().parents[2]
POLICY = "vae_service.serving.autoscaling_policy:DecoderScalingPolicy"
DEPLOYMENT = DeploymentID(name="VaeDecoder", app_name="vae")
IDLE = {
    "device_busy": 0.0,
    "realtime_wait_ms": 0.0,
    "interactive_wait_ms": 0.0,
    "session_room": 0.0,
    "bulk_backlog_s": 0.0,
    "sessions_open": 0.0,
    "connections": 0.0,
}
UNKNOWN = None  # a running replica that has not reported yet


def context(
    loads: list[dict | None],
    target: int | None = None,
    low: int = 1,
    high: int = 8,
    requests: float = 0.0,
    state: dict | None = None,
    upscale_delay_s: float = 10,
    downscale_delay_s: float = 300,
) -> AutoscalingContext:
    """Running replicas, one per load (their reports over the look-back: IDLE with `load` on top;
    UNKNOWN for one that has not reported); `target`: Serve's current target (default: as many as run)."""
    running = [ReplicaID(f"replica-{i}", DEPLOYMENT) for i in range(len(loads))]
    metrics: dict[str, dict] = {}
    for replica, load in zip(running, loads, strict=True):
        for name, value in ({} if load is UNKNOWN else {**IDLE, **load}).items():
            metrics.setdefault(name, {})[replica] = value
    config = AutoscalingConfig(
        min_replicas=low,
        max_replicas=high,
        target_ongoing_requests=2,
        upscale_delay_s=upscale_delay_s,
        downscale_delay_s=downscale_delay_s,
        policy=AutoscalingPolicy(policy_function=POLICY),
    )
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name,
        current_num_replicas=len(running),
        target_num_replicas=len(running) if target is None else target,
        running_replicas=running,
        total_num_requests=requests,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=config,
    )


def decided(ctx: AutoscalingContext, **targets) -> int:
    replicas, state = DecoderScalingPolicy(**targets)(ctx)
    assert state["decoder"]["replicas"] == replicas and state["decoder"]["reason"]
    return replicas


# ---- up ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([{"realtime_wait_ms": 100}], 2),  # twice the 50 ms target on one replica
        ([{"realtime_wait_ms": 75}] * 3, 5),  # 1.5x on 3: ceil(4.5)
        ([{"realtime_wait_ms": 5000}] * 2, 4),  # 100x: at most max_wait_step (2x) at once
        ([{"interactive_wait_ms": 300}] * 4, 5),  # 1.2x the 250 ms target on 4: ceil(4.8)
        ([{"interactive_wait_ms": 260}] * 6, 7),  # just past target: one more
        ([{"realtime_wait_ms": 60, "interactive_wait_ms": 500}] * 2, 4),  # the worse class decides
    ],
)
def test_a_latency_class_waiting_past_its_target_scales_up_proportionally(loads, expected):
    assert decided(context(loads)) == expected


def test_a_late_class_is_judged_by_its_mean_over_replicas_and_never_scales_down():
    # one replica's sessions wait (they are pinned to it: more replicas would not move them), the
    # other is idle: the mean is under target, so no scale-up, but no scale-down either
    hot = {"realtime_wait_ms": 80, "device_busy": 0.2}
    assert decided(context([hot, {}])) == 2
    assert decided(context([hot, {}, {}, {}])) == 4
    assert decided(context([{**hot, "realtime_wait_ms": 40}, {}, {}, {}])) == 1  # under target: down


@pytest.mark.parametrize(
    ("rooms", "expected"),
    [
        ([0.9], 2),  # past the 0.8 target: a second replica for the next sessions
        ([0.9, 0.9], 3),  # 1.8 of rooms at 0.8 each
        ([1.0, 1.0, 1.0, 0.95], 5),
        ([0.8, 0.8], 2),  # exactly at target: hold
    ],
)
def test_session_room_running_out_scales_up_to_enough_room(rooms, expected):
    assert decided(context([{"session_room": r} for r in rooms])) == expected


@pytest.mark.parametrize(
    ("backlogs", "expected"),
    [
        ([200], 4),  # 200 s of queued bulk work at 60 s per replica
        ([100, 100], 4),
        ([59, 0, 0], 1),  # less than a replica's worth: down to one
        ([30, 30, 30, 30], 2),
    ],
)
def test_bulk_backlog_scales_to_the_replicas_that_drain_it_at_target(backlogs, expected):
    assert decided(context([{"bulk_backlog_s": b} for b in backlogs])) == expected


def test_a_busy_device_alone_is_no_reason_to_scale_up():
    # a replica running bulk work flat out with nothing waiting is a well used GPU
    assert decided(context([{"device_busy": 1.0}])) == 1
    assert decided(context([{"device_busy": 1.0}] * 3)) == 3


# ---- idle sockets ---------------------------------------------------------------------------
@pytest.mark.parametrize("sockets", [4, 16, 32])
def test_idle_session_sockets_are_no_load_where_ongoing_requests_would_be(sockets):
    # every socket is an ongoing request for its whole life; half of them hold an open, idle session
    idle = {"connections": sockets, "sessions_open": sockets // 2, "session_room": 0.01 * (sockets // 2)}
    ctx = context([idle], requests=sockets)
    assert decided(ctx) == 1
    # Serve's default policy at target_ongoing_requests 2 would have asked for a replica per 2 sockets
    wanted, _ = replica_queue_length_autoscaling_policy(ctx)
    assert wanted == sockets / 2


def test_an_open_socket_keeps_one_replica_even_where_zero_is_allowed():
    assert decided(context([{"connections": 1}], low=0, requests=1)) == 1
    assert decided(context([{}], low=0, requests=0)) == 0


# ---- down -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([{}] * 2, 1),
        ([{}] * 8, 1),
        ([{"device_busy": 0.3}] * 4, 2),  # 1.2 of device time fits 2 replicas at 0.7
        ([{"device_busy": 0.7}] * 3, 3),  # exactly at target (2.1000000000000005 summed): hold
        ([{"device_busy": 0.5}] * 2, 2),  # 1.0 does not fit one replica at 0.7
        ([{"device_busy": 0.2, "session_room": 0.5}] * 3, 2),  # 1.5 of session room needs 2
        ([{"device_busy": 0.1, "bulk_backlog_s": 50}] * 4, 4),  # 200 s of backlog needs 4
    ],
)
def test_scales_down_to_the_fewest_replicas_holding_the_work_under_target(loads, expected):
    assert decided(context(loads)) == expected


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        ([0.3] * 3, 1),  # 0.9 of one replica's session caps: they all fit one
        ([0.5] * 3, 2),  # 1.5: a replica that goes must leave room for its sessions on the rest
        ([1.0] * 3, 3),  # every replica's caps full: none may go
        ([0.9, 0.0, 0.0], 1),
    ],
)
def test_the_session_caps_in_use_are_the_floor_of_a_scale_down(slots, expected):
    assert decided(context([{"session_slots": slot} for slot in slots])) == expected


def test_full_session_caps_alone_are_no_reason_to_scale_up():
    assert decided(context([{"session_slots": 1.0}])) == 1


def test_never_scales_down_while_a_latency_class_waits_past_target():
    late = {"interactive_wait_ms": 400}  # on one replica of 4: mean 100 ms, under target
    assert decided(context([late, {}, {}, {}])) == 4


# ---- missing data ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loads",
    [[UNKNOWN], [UNKNOWN, UNKNOWN], [{}, UNKNOWN], [{}, {}, {}, UNKNOWN], [UNKNOWN, {"device_busy": 0.1}, {}]],
)
def test_a_replica_that_has_not_reported_is_present_but_unknown_never_a_reason_to_scale_down(loads):
    assert decided(context(loads)) == len(loads)


def test_a_replica_reporting_only_part_of_the_figures_is_unknown():
    ctx = context([{}, {}])
    partial = ctx.running_replicas[1]
    del ctx.aggregated_metrics["session_room"][partial]
    replicas, state = DecoderScalingPolicy()(ctx)
    assert replicas == 2 and state["decoder"]["unknown"] == 1


def test_the_replicas_that_reported_can_still_scale_up():
    assert decided(context([{"realtime_wait_ms": 100}] * 2 + [UNKNOWN])) == 4
    # the proportion is the reporting replicas': one that has not reported may be the one just added for it
    assert decided(context([{"realtime_wait_ms": 100}, UNKNOWN])) == 2
    assert decided(context([{"bulk_backlog_s": 240}, UNKNOWN, UNKNOWN])) == 4


def test_no_running_replica_holds_serves_target():
    assert decided(context([], target=2, low=0)) == 2


# ---- scaling in flight, bounds ----------------------------------------------------------------
def test_a_scale_up_in_flight_is_not_asked_for_again():
    # 2 running of a target of 4: 1.5x the wait on the 2 running asks for 3, already under way
    assert decided(context([{"realtime_wait_ms": 75}] * 2, target=4)) == 4
    # a target of 4 never reached (no room for more): idle, it still comes down
    assert decided(context([{}] * 2, target=4)) == 1


@pytest.mark.parametrize(
    ("loads", "low", "high", "expected"),
    [
        ([{"bulk_backlog_s": 6000}], 1, 8, 8),
        ([{"realtime_wait_ms": 500}] * 3, 1, 4, 4),
        ([{}] * 4, 2, 8, 2),
        ([{}] * 4, 3, 3, 3),
    ],
)
def test_decisions_stay_within_the_capacity_adjusted_bounds(loads, low, high, expected):
    assert decided(context(loads, low=low, high=high)) == expected


def test_targets_are_the_policy_kwargs():
    loads = [{"realtime_wait_ms": 30, "device_busy": 0.45}] * 2
    assert decided(context(loads)) == 2
    assert decided(context(loads), realtime_wait_ms=20) == 3
    assert decided(context(loads), target_device_busy=0.95) == 1
    with pytest.raises(ValueError, match="session_room"):
        DecoderScalingPolicy(session_room=0)
    with pytest.raises(ValueError, match="max_wait_step"):
        DecoderScalingPolicy(max_wait_step=1)


# ---- delays: Serve's, applied around the policy ------------------------------------------------
def serve_tick(policy, ctx: AutoscalingContext) -> tuple[int, dict]:
    """What the controller does with a custom policy each tick (autoscaling_state.py): Serve's
    wrapper (factors, delays), then the bounds."""
    replicas, state = _apply_autoscaling_config(policy)(ctx)
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, replicas)), state


def aged(state: dict, seconds: float) -> dict:
    """The state of a decision first asked for `seconds` ago."""
    return {
        **state,
        SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY: state[SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY] - seconds,
    }


def test_serve_applies_the_upscale_delay_to_the_policy():
    policy, late = DecoderScalingPolicy(), [{"realtime_wait_ms": 100}] * 2
    replicas, state = serve_tick(policy, context(late))
    assert replicas == 2 and state["decoder"]["replicas"] == 4  # wanted, not yet for 10 s
    replicas, state = serve_tick(policy, context(late, state=aged(state, 5)))
    assert replicas == 2
    replicas, _ = serve_tick(policy, context(late, state=aged(state, 6)))  # 11 s asked for without a break
    assert replicas == 4


def test_serve_applies_the_downscale_delay_and_a_late_class_restarts_it():
    policy, idle = DecoderScalingPolicy(), [{}] * 3
    replicas, state = serve_tick(policy, context(idle))
    assert replicas == 3 and state["decoder"]["replicas"] == 1
    # a late class holds: the scale-down asked for 299 s is forgotten
    late = [{"interactive_wait_ms": 400}, {}, {}]
    replicas, held = serve_tick(policy, context(late, state=aged(state, 299)))
    assert replicas == 3 and held[SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY] is None
    replicas, state = serve_tick(policy, context(idle, state=held))
    assert replicas == 3
    replicas, _ = serve_tick(policy, context(idle, state=aged(state, 301)))
    assert replicas == 1


def test_zero_delays_act_at_once():
    replicas, _ = serve_tick(
        DecoderScalingPolicy(), context([{"session_room": 1.5}], upscale_delay_s=0, downscale_delay_s=0)
    )
    assert replicas == 2


# ---- how Serve loads it -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["serve-gpu.yaml", "rayservice.yaml"])
def test_the_deploy_yamls_name_the_policy_and_serve_builds_it_with_their_targets(name):
    raw = yaml.safe_load((REPO / "deploy" / name).read_text())
    if name == "rayservice.yaml":
        raw = yaml.safe_load(raw["spec"]["serveConfigV2"])
    (deployment,) = raw["applications"][0]["deployments"]
    config = AutoscalingConfig.model_validate(deployment["autoscaling_config"])
    assert config.policy.policy_function == POLICY
    policy = _resolve_policy_callable(config.policy)  # cloudpickled by value, then instantiated once
    assert type(policy).__name__ == "DecoderScalingPolicy"
    kwargs = config.policy.policy_kwargs
    assert policy.wait_targets_ms == {
        "realtime": kwargs["realtime_wait_ms"],
        "interactive": kwargs["interactive_wait_ms"],
    }
    assert (policy.target_device_busy, policy.session_room, policy.bulk_backlog_s) == (
        kwargs["target_device_busy"],
        kwargs["session_room"],
        kwargs["bulk_backlog_s"],
    )
    assert config.upscale_delay_s < config.downscale_delay_s


def test_the_policy_module_imports_only_the_standard_library():
    """Serve pickles it by value into its controller, where neither torch nor the service is wanted."""
    script = (
        "import json, sys; import vae_service.serving.autoscaling_policy; "
        "print(json.dumps(sorted(m for m in sys.modules if not m.startswith('_'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    modules = json.loads(out.stdout)
    ours = {m for m in modules if m.split(".")[0] == "vae_service"}
    assert ours == {"vae_service", "vae_service.serving", "vae_service.serving.autoscaling_policy"}
    foreign = sorted(m for m in modules if m.split(".")[0] not in sys.stdlib_module_names and m not in ours)
    assert foreign == []
