"""deploy/serve-gpu.yaml on a real multi-node Ray cluster (conftest.py: worker nodes that Ray's
autoscaler adds and removes on this machine, one decode replica per node):

- load makes Serve ask for replicas, the autoscaler adds nodes, the new replicas decode; once the
  load ends they go, releasing the fast path's folded buffers, and their idle nodes are removed;
- a worker node lost under load costs clients nothing but retries: 200 or 503 + Retry-After,
  and every request is answered, correctly, through Serve's or the client's retries;
- one request's tiles decoded on two nodes are the one-replica plan bit for bit.

The tests share one cluster (tests/cluster/conftest.py) but none relies on another having run:
each deploys what it needs and waits for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.cluster.conftest import APP, DEPLOYMENT, FakeCluster, serve_gpu_config, wait_for
from tests.models import reference_decode, torch_threads
from tests.peers import here_only
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service_client import VaeClient

pytestmark = pytest.mark.cluster
FOLDED = "ray_vae_folded_buffer_bytes"
LOAD_CLIENTS = 8  # against target_ongoing_requests=2: Serve wants all 3 replicas there can be
HIGH_MAX_ERROR = 1e-3  # the `high` tier's contract in fp32: max error against `lossless`


def z_for(client: int) -> torch.Tensor:
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(client))


class Load:
    """`clients` threads, each decoding its own latent (z_for) again and again through VaeClient
    with its default retries; every HTTP answer's status recorded (retried attempts too), every
    decode checked, every request the client gave up on kept."""

    def __init__(self, url: str, quality: str, check: Callable[[int, np.ndarray], bool], clients: int = LOAD_CLIENTS):
        self.url, self.quality, self.check = url, quality, check
        self.statuses: Counter = Counter()  # (status, has Retry-After) -> answers
        self.answered: Counter = Counter()  # client -> requests answered
        self.attempts: Counter = Counter()  # HTTP attempts a request took -> requests
        self.wrong: list[int] = []
        self.lost: list[str] = []
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)
        assert not any(t.is_alive() for t in self._threads), "a load client hung"

    def total(self) -> int:
        with self._lock:
            return sum(self.answered.values())

    def _run(self, i: int) -> None:
        z, tries = z_for(i), []

        def record(response) -> None:
            tries.append(1)
            with self._lock:
                self.statuses[(response.status_code, "retry-after" in response.headers)] += 1

        with VaeClient(self.url, timeout=120) as client:
            client._http.event_hooks["response"] = [record]  # each attempt, not only the last
            while not self._stop.is_set():
                tries.clear()
                try:
                    answer = client.decode(z, quality=self.quality, output="float", scaling_factor=None)
                except Exception as exc:
                    with self._lock:
                        self.lost.append(repr(exc))
                    continue
                ok = self.check(i, answer.output)
                with self._lock:
                    self.answered[i] += 1
                    self.attempts[len(tries)] += 1
                    if not ok:
                        self.wrong.append(i)


@pytest.fixture(scope="module")
def expected(kl_reference) -> list[np.ndarray]:
    """Each load client's latent decoded by diffusers itself (`lossless`: one latent, one torch thread)."""
    with torch_threads(1):
        return [reference_decode(kl_reference, z_for(i)).numpy() for i in range(LOAD_CLIENTS)]


def deployed(cluster: FakeCluster, config: dict, replicas: int = 1) -> dict[str, str]:
    """`config` running, with `replicas` replicas on as many worker nodes: replica -> node."""
    cluster.deploy(config)
    wait_for("the application running", lambda: cluster.app_status() == "RUNNING", 240)

    def settled():
        placed = cluster.replicas()
        return len(placed) == replicas and len(set(placed.values())) == replicas and placed

    return wait_for(f"{replicas} replicas on {replicas} nodes", settled, 240)


def health_by_replica(client: VaeClient, want: set[str], timeout_s: float) -> dict[str, dict]:
    """/health of each replica in `want` (Serve routes each call to one: call until all answered)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while not want <= set(seen):
        assert time.monotonic() < deadline, f"/health answered by {sorted(seen)} only, of {sorted(want)}"
        health = client.health()
        seen[health["replica"]] = health
        time.sleep(0.05)
    return seen


def test_load_adds_nodes_and_replicas_then_idle_removes_them_with_their_folded_buffers(fake_cluster, expected):
    cluster = fake_cluster
    (first_node,) = deployed(cluster, serve_gpu_config(cluster.model, cluster.http_port, cluster.grpc_port)).values()
    # another module's nodes, idle now, go first (the cluster is tests/cluster's)
    wait_for("only the deployment's node", lambda: cluster.worker_nodes() == {first_node}, 90)
    close = lambda i, out: float(np.abs(out - expected[i]).max()) <= HIGH_MAX_ERROR  # noqa: E731
    with (load := Load(cluster.url, "high", close)):
        # Serve asks for more replicas than its one node holds; the autoscaler adds a node for each
        wait_for("3 replicas on 3 worker nodes", lambda: len(set(cluster.replicas().values())) == 3, 180)
        placed = cluster.replicas()
        assert len(cluster.worker_nodes()) == 3 and first_node in cluster.worker_nodes()
        logs = {r["replica_id"]: cluster.log(r["log_file_path"]) for r in cluster.replica_details()}
        # each decodes answers of the load (`high`: its folded buffers built), each on its own node
        with VaeClient(cluster.url) as client:

            def all_decoding():
                health = health_by_replica(client, set(placed), 60)
                busy = all(h["decoded_items"] > 0 and h["fast_path"]["folded_bytes"] > 0 for h in health.values())
                return busy and health

            health = wait_for("every replica decoding", all_decoding, 60)
    assert load.total() > 0 and not load.lost and not load.wrong, (load.lost[:3], load.wrong[:3])
    assert set(load.statuses) == {(200, False)}, load.statuses
    folded = {replica: h["fast_path"]["folded_bytes"] for replica, h in health.items()}
    assert set(folded) == set(placed) and len(set(placed.values())) == 3

    # the load ended: back to min_replicas; each replica that goes releases its folded buffers: its
    # gauge reads 0 (scraped from its node's Prometheus endpoint, while the node is still there) ...
    gauge: dict[str, float] = {}

    def scraped(done: Callable[[], bool]) -> Callable[[], bool]:
        def check() -> bool:
            for name, value in cluster.metrics(FOLDED).items():
                gauge[re.search(r'replica="([^"]+)"', name).group(1)] = value
            return done()

        return check

    wait_for("one replica left", scraped(lambda: len(cluster.replicas()) == 1), 120, every_s=0.25)
    (kept,) = cluster.replicas()
    gone = set(placed) - {kept}
    assert len(gone) == 2
    wait_for(f"gauge 0 for {sorted(gone)}", scraped(lambda: all(gauge.get(r) == 0 for r in gone)), 30, every_s=0.25)
    # ... says so in its log (after draining what it held) ...
    for replica in gone:
        released = f"shutting down: drained=True, released {folded[replica]} bytes of folded buffers"
        assert released in logs[replica].read_text()
    # ... and the autoscaler removes the idle nodes: the one left is the kept replica's
    wait_for("idle nodes removed", lambda: cluster.worker_nodes() == {cluster.replicas()[kept]}, 90)


def test_a_node_killed_under_load_costs_clients_only_retries(fake_cluster, expected):
    cluster = fake_cluster
    deployed(cluster, serve_gpu_config(cluster.model, cluster.http_port, cluster.grpc_port))
    exact = lambda i, out: np.array_equal(out, expected[i])  # noqa: E731 (lossless: bit for bit)
    with (load := Load(cluster.url, "lossless", exact)):

        def spread():
            placed = cluster.replicas()
            return len(set(placed.values())) >= 2 and placed

        placed = wait_for("replicas on 2 nodes or more", spread, 180)
        with VaeClient(cluster.url) as client:
            # a RUNNING replica may not be routed to yet: the victim's must be decoding the load, so
            # that the kill catches requests in flight
            def decoding():
                health = health_by_replica(client, set(placed), 60)
                return sorted(r for r, h in health.items() if h["decoded_items"] > 0)

            victim_replica = wait_for("a replica decoding the load", decoding, 60)[-1]
            victim = placed[victim_replica]
        for pid in cluster.node_pids(victim):  # the whole node at once, as when its machine goes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        at_kill = load.total()
        wait_for("the node declared dead", lambda: victim not in cluster.worker_nodes(), 120)
        # and served on: the load's requests keep being answered after the node's loss
        wait_for("answers after the loss", lambda: load.total() > at_kill + 4 * LOAD_CLIENTS, 120)
    assert not load.lost and not load.wrong, (load.lost[:3], load.wrong[:3])  # every request answered, right
    assert all(load.answered[i] > 0 for i in range(LOAD_CLIENTS))
    # what clients saw: answers and 503 + Retry-After, never a 500 nor a 503 without Retry-After
    assert set(load.statuses) <= {(200, False), (503, True)}, load.statuses
    # and the kill caught requests in flight: Serve's router sent them again to another replica while
    # the node was not yet declared dead (its proxy logs the victim unavailable), or, once it was,
    # clients got 503 + Retry-After and retried
    rerouted = f"Replica(id='{victim_replica}', deployment='{DEPLOYMENT}', app='{APP}') is temporarily unavailable"
    proxy_logs = "".join(log.read_text() for log in cluster.log("serve").glob("proxy_*.log"))
    retried = load.statuses[(503, True)] > 0 and max(load.attempts) > 1
    assert retried or rerouted in proxy_logs, ("the kill caught no request", load.statuses, load.attempts)


SPREAD = {"min_output_pixels": 48 * 48}  # 64x64-pixel tiles of 8 latent px, shared while a replica is idle


def test_tiles_decoded_on_two_nodes_are_the_one_replica_plan_bit_for_bit(fake_cluster):
    cluster = fake_cluster
    config = serve_gpu_config(cluster.model, cluster.http_port, cluster.grpc_port, parallel=SPREAD)
    (app,) = config["applications"]
    app["deployments"][0]["autoscaling_config"].update(min_replicas=2, initial_replicas=2, max_replicas=2)
    deployed(cluster, config, replicas=2)
    z = torch.randn(1, 4, 24, 26, generator=torch.Generator().manual_seed(21))
    with VaeClient(cluster.url) as client:
        answer = client.decode(z, quality="high", output="float", scaling_factor=None)
    args = ServiceConfig.model_validate(app["args"])  # the replicas' own config, as in test_spread.py
    assert args.device == "cpu" and args.cpu_threads == 1 and args.parallel.tiles_across_replicas
    engine = DecodeEngine(args)
    with torch_threads(1):
        request = DecodeRequest(z, quality="high", output="float", latents_scaled=True)
        (one,) = engine.decode([here_only(engine.prepare(request))])  # the same tiles, all decoded here
    assert answer.tiled and answer.quality == "high"
    assert answer.timing["replicas"] == 2  # both replicas decoded tiles, each on its own node
    assert len(set(cluster.replicas().values())) == 2
    assert np.array_equal(answer.output, one.output.numpy())
