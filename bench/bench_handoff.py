"""What a live session pays when its replica goes, at several session lengths, side by side in one
run on a local Ray cluster (two replicas, the WebSocket client):

- handoff: the application is deployed again (a rolling update: every replica drains), the
  session's state goes through the session keeper, and the client's next chunk attaches on a new
  replica. Its pause: that chunk's latency less a steady chunk's;
- replay: the session's replica is killed with no state kept (`sessions.checkpoint_every_chunks` 0),
  and the client (resume=True) replays every latent frame in a new session before its next chunk.
  Its pause: that chunk's latency less a steady chunk's;
- checkpoint: the replica is killed with a checkpoint every 4 chunks: the client sends again only
  the chunks after the latest one.

Printed per length: the session's state bytes (its causal cache, as handed over), the pause of each
way, the latent frames each sent again, and the replay's pause over the handoff's. A preset with
SEEDED RANDOM WEIGHTS (it decodes noise; the timings do not depend on the weights): tiny-wan at
12x16 latents, chunks of one latent frame, by default.

Usage: python bench/bench_handoff.py [--lengths 8 32 96] [--model tiny-wan] [--latent-hw 12 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.replicas_from_file, for Serve's controller
from _common import local_serve, print_table

APP = "handoff-bench"
POLICY = "tests.replicas_from_file:ReplicasFromFile"


def deploy(model: str, checkpoint_every: int, count_file: Path) -> None:
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {
        "model": model,
        "cpu_threads": 1,
        "limits": {"max_sessions": 4, "max_session_chunk_frames": 4},
        "sessions": {"idle_timeout_s": 600, "checkpoint_every_chunks": checkpoint_every},
    }
    count_file.write_text("2")
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "initial_replicas": 2,
        "upscale_delay_s": 0.1,
        "downscale_delay_s": 0.1,
        "policy": {"policy_function": POLICY, "policy_kwargs": {"path": str(count_file)}},
    }
    app = decoder_app(
        config,
        autoscaling_config=autoscaling,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=0.05,
        graceful_shutdown_timeout_s=60,
    )
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    wait_running(2)


def wait_running(replicas: int) -> None:
    from ray import serve

    while True:
        status = serve.status().applications[APP]
        states = next(iter(status.deployments.values())).replica_states
        if status.status == "RUNNING" and states.get("RUNNING", 0) == replicas and sum(states.values()) == replicas:
            return
        time.sleep(0.1)


def kill_owner(session_id: str) -> None:
    import ray

    owner = session_id.split(".", 1)[0]
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{APP}#") and actor["name"].endswith(owner):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def timed(session, z) -> float:
    start = time.perf_counter()
    session.decode(z)
    return time.perf_counter() - start


def run_length(url: str, length: int, h: int, w: int, go, resume: bool) -> dict:
    """A session of `length` chunks, then `go(session)` takes its replica away, then one more chunk."""
    from vae_service_client import VaeClient

    rng = np.random.default_rng(length)
    z = rng.standard_normal((1, 16, length + 1, h, w)).astype(np.float32)
    with VaeClient(url, timeout=600).session(h, w, resume=resume) as session:
        z = z[:, : session.opened["latent_channels"]]
        steady = [timed(session, z[:, :, k : k + 1]) for k in range(length)]
        go(session)
        after = timed(session, z[:, :, length:])
        return {
            "steady_s": statistics.median(steady[1:]),
            "pause_s": after - statistics.median(steady[1:]),
            "replayed": session.replayed_latent_frames,
            "state_bytes": session.opened.get("held_bytes", 0),
            "attaches": session.attaches,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 96])
    parser.add_argument("--model", default="tiny-wan")
    parser.add_argument("--latent-hw", type=int, nargs=2, default=[12, 16])
    args = parser.parse_args()
    h, w = args.latent_hw
    with tempfile.TemporaryDirectory() as tmp, local_serve() as base:
        count = Path(tmp) / "replicas"
        url, rows = f"{base}/{APP}", []
        for length in args.lengths:
            deploy(args.model, 0, count)
            handoff = run_length(url, length, h, w, lambda s: deploy(args.model, 0, count), resume=False)
            replay = run_length(url, length, h, w, lambda s: (kill_owner(s.session_id), time.sleep(1)), resume=True)
            deploy(args.model, 4, count)
            checkpointed = run_length(
                url, length, h, w, lambda s: (time.sleep(1), kill_owner(s.session_id), time.sleep(1)), resume=True
            )
            rows.append(
                [
                    length,
                    handoff["state_bytes"],
                    round(handoff["steady_s"] * 1e3, 1),
                    round(handoff["pause_s"] * 1e3, 1),
                    handoff["replayed"],
                    round(replay["pause_s"] * 1e3, 1),
                    replay["replayed"],
                    round(checkpointed["pause_s"] * 1e3, 1),
                    checkpointed["replayed"],
                    round(replay["pause_s"] / max(handoff["pause_s"], 1e-3), 1),
                ]
            )
    print_table(
        f"A session's replica goes: handoff vs replay ({args.model}, {h}x{w} latents, 1 latent frame a chunk)",
        [
            "latent frames",
            "state bytes",
            "steady chunk ms",
            "handoff pause ms",
            "replayed",
            "replay pause ms",
            "replayed",
            "checkpoint pause ms",
            "replayed",
            "replay / handoff",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
