"""The autoscaling trace of a ramp of decode sessions beside bulk work: Serve's default policy
(`target_ongoing_requests`) and the decoder's policy (vae_service/serving/autoscaling_policy.py,
docs/autoscaling.md) side by side in one run, the same load sent to both at once.

A local single-node Ray cluster (bench/_common.py's local_serve) with two applications of the same
decoder, `/default` and `/ours`, replicas of num_cpus 0 (Serve places them all on this machine), the
`tiny-wan` preset with SEEDED RANDOM WEIGHTS (it decodes noise; timings do not depend on weights),
one torch thread per replica. Autoscaling on a bench's time scale for both: 1-3 replicas, upscale
delay 2 s, downscale delay 5 s, look-back 3 s; the default at target_ongoing_requests 2, ours with
its targets on this CPU's scale (POLICY_TARGETS).

The load, per application (the same for both, sent at the same time):
- sessions: one more every RAMP_EVERY_S up to SESSIONS; each sends a one-latent-frame chunk every
  CHUNK_EVERY_S (`realtime`), and waits for its answer;
- an interactive probe: one one-latent-frame /decode every second (`interactive`);
- bulk: BULK_CLIENTS clients decoding BULK_FRAMES-latent-frame clips (`priority: bulk`), one
  after another, from BULK_FROM_S to BULK_UNTIL_S;
- then everything stops at SESSIONS_UNTIL_S and the trace watches the replicas go.

Printed every second, per policy: replicas (RUNNING), the p90 queue wait of the realtime chunks and
interactive probes answered in that second (their answers' timing.queue_ms), and the session room
(open sessions' priced bytes over the budget of the replicas running, as the replicas report it);
then a summary: replica-seconds, the most replicas, the realtime and interactive p90 over the run.

Usage: python bench/bench_autoscaling.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table

SESSIONS, RAMP_EVERY_S, CHUNK_EVERY_S = 8, 4.0, 1.0
BULK_CLIENTS, BULK_FRAMES = 6, 5
BULK_FROM_S, BULK_UNTIL_S, SESSIONS_UNTIL_S, END_S = 20.0, 60.0, 75.0, 95.0
H, W = 6, 10  # latents: a 48x80-pixel video
CONFIG = {
    "model": "tiny-wan",
    "cpu_threads": 1,
    "batching": {"max_batch_size": 4},
    "serving": {"concurrent_keys": 4},  # 16 decode slots: at most 12 session connections
    "sessions": {"idle_timeout_s": 300},
}
SCALING = {
    "min_replicas": 1,
    "initial_replicas": 1,
    "max_replicas": 3,
    "upscale_delay_s": 2,
    "downscale_delay_s": 5,
    "look_back_period_s": 3,
    "metrics_interval_s": 0.5,
    "target_ongoing_requests": 2,
}
# this CPU's scale: a tiny chunk decodes in tens of ms on one thread
POLICY_TARGETS = {"realtime_wait_ms": 100, "interactive_wait_ms": 200, "bulk_backlog_s": 2, "session_room": 0.8}
POLICY = "vae_service.serving.autoscaling_policy:DecoderScalingPolicy"
APPS = ("default", "ours")


class Trace:
    """What one application's load saw, per second of the run."""

    def __init__(self, app: str, url: str):
        self.app, self.url = app, f"{url}/{app}"
        self.lock = threading.Lock()
        self.waits: dict[str, dict[int, list[float]]] = {"realtime": {}, "interactive": {}}
        self.held_bytes = 0  # open sessions' priced bytes (their `opened.held_bytes`)
        self.sessions = 0
        self.bulk_done = 0
        self.errors: list[str] = []

    def wait(self, cls: str, second: int, queue_ms: float) -> None:
        with self.lock:
            self.waits[cls].setdefault(second, []).append(queue_ms)


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def deploy() -> None:
    from ray import serve

    from vae_service.serving.app import decoder_app

    for app in APPS:
        scaling = dict(SCALING)
        if app == "ours":
            scaling["policy"] = {"policy_function": POLICY, "policy_kwargs": POLICY_TARGETS}
        options = {"ray_actor_options": {"num_cpus": 0}, "autoscaling_config": scaling}
        serve.run(decoder_app(CONFIG, **options), name=app, route_prefix=f"/{app}", blocking=False)
    for app in APPS:
        while serve.status().applications[app].status != "RUNNING":
            time.sleep(0.5)


def replicas(app: str) -> int:
    from ray import serve

    (deployment,) = serve.status().applications[app].deployments.values()
    return deployment.replica_states.get("RUNNING", 0)


def run_session(trace: Trace, t0: float, stop: threading.Event) -> None:
    from vae_service_client import VaeClient

    try:
        with VaeClient(trace.url, timeout=120) as client, client.session(H, W) as session:
            channels = session.opened["latent_channels"]
            with trace.lock:
                trace.held_bytes += session.opened["held_bytes"]
                trace.sessions += 1
            rng = np.random.default_rng(0)
            try:
                while not stop.is_set():
                    began = time.monotonic()
                    chunk = session.decode(rng.standard_normal((1, channels, 1, H, W)).astype(np.float32))
                    trace.wait("realtime", int(time.monotonic() - t0), chunk.timing["queue_ms"])
                    stop.wait(max(0.0, CHUNK_EVERY_S - (time.monotonic() - began)))
            finally:
                with trace.lock:
                    trace.held_bytes -= session.opened["held_bytes"]
                    trace.sessions -= 1
    except Exception as exc:  # recorded: the summary counts them
        trace.errors.append(f"session: {exc!r}"[:200])


def run_decodes(trace: Trace, t0: float, stop: threading.Event, bulk: bool, channels: int) -> None:
    from vae_service_client import VaeClient

    frames = BULK_FRAMES if bulk else 1
    z = np.random.default_rng(1).standard_normal((1, channels, frames, H, W)).astype(np.float32)
    with VaeClient(trace.url, timeout=120) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                answer = client.decode(z, priority="bulk" if bulk else None)
            except Exception as exc:
                trace.errors.append(f"decode: {exc!r}"[:200])
                stop.wait(1.0)
                continue
            if bulk:
                trace.bulk_done += 1
            else:
                trace.wait("interactive", int(time.monotonic() - t0), answer.timing["queue_ms"])
                stop.wait(max(0.0, 1.0 - (time.monotonic() - began)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the ramp and the phases")
    args = parser.parse_args()
    scale = 0.5 if args.quick else 1.0
    with local_serve() as url:
        deploy()
        from vae_service_client import VaeClient

        with VaeClient(f"{url}/ours") as client:
            health = client.health()
        budget = health["sessions"]["budget_bytes"]
        channels = health["latent_channels"]
        traces = {app: Trace(app, url) for app in APPS}
        t0 = time.monotonic()
        stops = {name: threading.Event() for name in ("sessions", "bulk", "probe")}
        threads: list[threading.Thread] = []

        def start(target, *a) -> None:
            thread = threading.Thread(target=target, args=a, daemon=True)
            thread.start()
            threads.append(thread)

        for trace in traces.values():
            start(run_decodes, trace, t0, stops["probe"], False, channels)
        rows, opened, bulk_on = [], 0, False
        for second in range(int(END_S * scale) + 1):
            now = second  # the loop keeps to whole seconds since t0
            while opened < SESSIONS and now >= opened * RAMP_EVERY_S * scale and now < SESSIONS_UNTIL_S * scale:
                for trace in traces.values():
                    start(run_session, trace, t0, stops["sessions"])
                opened += 1
            if not bulk_on and BULK_FROM_S * scale <= now < BULK_UNTIL_S * scale:
                bulk_on = True
                for trace in traces.values():
                    for _ in range(BULK_CLIENTS):
                        start(run_decodes, trace, t0, stops["bulk"], True, channels)
            if now >= BULK_UNTIL_S * scale:
                stops["bulk"].set()
            if now >= SESSIONS_UNTIL_S * scale:
                stops["sessions"].set()
                stops["probe"].set()
            row = [second, traces["ours"].sessions, "on" if bulk_on and not stops["bulk"].is_set() else ""]
            for app in APPS:
                trace, count = traces[app], replicas(app)
                with trace.lock:
                    rt = p90(trace.waits["realtime"].get(second - 1, []))
                    it = p90(trace.waits["interactive"].get(second - 1, []))
                    room = trace.held_bytes / (budget * max(1, count))
                row += [count, _ms(rt), _ms(it), round(room, 3)]
            rows.append(row)
            print(" ".join(str(c) for c in row), file=sys.stderr, flush=True)  # progress
            time.sleep(max(0.0, t0 + second + 1 - time.monotonic()))
        for stop in stops.values():
            stop.set()
        for thread in threads:
            thread.join(timeout=60)
    header = ["t s", "sessions", "bulk"]
    for app in APPS:
        header += [f"{app} replicas", f"{app} rt p90 ms", f"{app} int p90 ms", f"{app} room"]
    print_table("autoscaling trace (per second; waits of the second before)", header, rows)
    summary = []
    for i, app in enumerate(APPS):
        counts = [row[3 + 4 * i] for row in rows]
        trace = traces[app]
        everything = {cls: [w for ws in trace.waits[cls].values() for w in ws] for cls in trace.waits}
        summary.append(
            [
                app,
                sum(counts),
                max(counts),
                _ms(p90(everything["realtime"])),
                _ms(p90(everything["interactive"])),
                _ms(statistics.median(everything["realtime"])) if everything["realtime"] else "-",
                trace.bulk_done,
                len(trace.errors),
            ]
        )
    print_table(
        "summary",
        ["policy", "replica-s", "max replicas", "rt p90 ms", "int p90 ms", "rt p50 ms", "bulk clips", "errors"],
        summary,
    )
    for trace in traces.values():
        for error in trace.errors[:3]:
            print(f"{trace.app}: {error}")


def _ms(value: float | None):
    return "-" if value is None else round(value, 1)


if __name__ == "__main__":
    main()
