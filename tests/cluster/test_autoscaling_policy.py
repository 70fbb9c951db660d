"""The decoder's autoscaling policy (docs/autoscaling.md) deciding for a real deployment of
deploy/serve-gpu.yaml on the fake multi-node cluster (conftest.py; the policy's targets on the test's
time scale there):

- a bulk backlog (many concurrent `priority="bulk"` decodes) adds replicas within the policy's
  delays, and they go once it has drained.

Idle decode sessions are no reason to add a replica: test_session_drains.py watches it before its
ramp. Each test deploys what it needs; the package's tests share one cluster.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.cluster.conftest import FakeCluster, serve_gpu_config, wait_for
from tests.cluster.test_multi_node import deployed
from vae_service_client import VaeClient

pytestmark = pytest.mark.cluster
BULK_CLIENTS = 12


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
