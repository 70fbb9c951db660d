"""The decoder's autoscaling policy (docs/autoscaling.md) deciding for a real deployment of
deploy/serve-gpu.yaml on the fake multi-node cluster (conftest.py; the policy's targets on the test's
time scale there):

- idle decode sessions (each an open WebSocket: one ongoing request for its whole life) leave the
  deployment at one replica over many policy periods. Serve's default policy at the same
  `target_ongoing_requests: 2` would want a replica per two sockets (shown in the unit tests, which
  run Serve's own default policy on such a context: here only ours is deployed);
- a bulk backlog (many concurrent `priority="bulk"` decodes) adds replicas within the policy's
  delays, and they go once it has drained.

Each test deploys what it needs; they share one cluster.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.cluster.conftest import FakeCluster, serve_gpu_config, wait_for
from tests.cluster.test_multi_node import deployed
from tests.session_wire import C, H, W
from vae_service_client import VaeClient

pytestmark = pytest.mark.cluster
SESSIONS = 6  # sockets: Serve's default policy at target_ongoing_requests 2 would want 3 replicas
WATCH_S = 10.0  # five look-back periods (2 s) of ten upscale delays (1 s)
BULK_CLIENTS = 12


def test_idle_decode_sessions_are_no_reason_to_add_replicas(fake_cluster: FakeCluster, wan_dir):
    cluster = fake_cluster
    config = serve_gpu_config(
        wan_dir, cluster.http_port, cluster.grpc_port, model_name="wan", sessions={"idle_timeout_s": 120}
    )
    deployed(cluster, config)
    with VaeClient(cluster.url) as client:
        sessions = [client.session(H, W) for _ in range(SESSIONS)]
        try:
            chunk = np.random.default_rng(0).standard_normal((1, C, 1, H, W)).astype(np.float32)
            sessions[0].decode(chunk)  # a session that has decoded, then idles like the rest
            held = client.health()["sessions"]
            assert (held["open"], held["connections"]) == (SESSIONS, SESSIONS)
            # they hold room (open sessions' priced bytes), under the 0.8 target
            assert 0 < held["held_bytes"] < 0.8 * held["budget_bytes"]
            seen = set()
            deadline = time.monotonic() + WATCH_S
            while time.monotonic() < deadline:
                seen.add(len(cluster.replicas()))
                time.sleep(0.25)
            assert seen == {1}, seen
            assert client.health()["sessions"]["open"] == SESSIONS  # still held: the watch was not idle of them
        finally:
            for session in sessions:
                session.close()


def test_a_bulk_backlog_adds_replicas_and_they_go_once_it_drains(fake_cluster: FakeCluster):
    cluster = fake_cluster
    deployed(cluster, serve_gpu_config(cluster.model, cluster.http_port, cluster.grpc_port))
    z = np.random.default_rng(1).standard_normal((1, 4, 64, 64)).astype(np.float32)
    stop, answered, failed = threading.Event(), [], []

    def client_loop() -> None:
        with VaeClient(cluster.url) as client:
            while not stop.is_set():
                try:
                    client.decode(z, priority="bulk")
                    answered.append(1)
                except Exception as exc:  # a replica going away may cost a retry; recorded, not raised
                    failed.append(repr(exc))

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(BULK_CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        started = time.monotonic()
        wait_for("a second replica for the backlog", lambda: len(cluster.replicas()) >= 2, 180)
        scaled_after_s = time.monotonic() - started
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert answered and not failed, failed[:3]
    print(f"scaled up {scaled_after_s:.1f} s into the backlog")
    # drained: busy 0, nothing queued; down to one after the downscale delay (2 s) and look-back (2 s)
    wait_for("back to one replica", lambda: len(cluster.replicas()) == 1, 90)
