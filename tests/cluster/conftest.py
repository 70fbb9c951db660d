"""A real multi-node Ray cluster on this one machine: Ray's autoscaler with its fake multi-node
provider (deploy/fake-cluster.yaml) starts real raylets here as worker nodes, one decode replica
each (a custom resource, `decoder_slot`, stands in for a GPU). Serve runs deploy/serve-gpu.yaml
with only what must differ on a CPU-only, single-machine cluster overridden (`serve_gpu_config`).

The pytest process may already be the driver of the integration tests' local Ray (a process is
the driver of one cluster at most), so nothing here calls `ray.init`: the cluster is started with
`ray start`, Serve is driven with the `serve deploy` CLI, and everything else goes over HTTP (the
dashboard's state and Serve REST APIs, the service itself, the nodes' Prometheus endpoints).

The head listens on a free port, not Ray's default 6379 (other clusters on the machine may hold
it): the fake provider starts its workers against `provider.gcs_address` when given (else 6379).

Teardown never uses `ray stop` (it stops every Ray on the machine by name): it ends the
processes whose command line or open files lie under this cluster's own temp dir, and their
children, SIGTERM first, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.ports import free_port
from vae_service.config import ServiceConfig
from vae_service.serving.wire.proxy_guard import proxy_guard_env

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
APP = "vae"
DEPLOYMENT = "VaeDecoder"
SLOT = "decoder_slot"  # the custom resource standing in for `num_gpus: 1`


def wait_for(what: str, check: Callable[[], object], timeout_s: float, every_s: float = 0.5):
    """Poll `check` until it returns something truthy; its last value in the failure message."""
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            last = check()
        except (httpx.HTTPError, OSError) as exc:  # a component still starting or just gone
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")
        time.sleep(every_s)


def serve_gpu_config(model: Path, http_port: int, grpc_port: int, **args) -> dict:
    """deploy/serve-gpu.yaml, with only what must differ here overridden; `args` on top of its args.

    - one machine: every node shares its ports, so one proxy (on the head) on free ports;
    - no GPU: the custom resource `decoder_slot` per replica (one per worker node) instead of
      `num_gpus: 1`, one CPU (a worker node has one), `device: cpu` with one torch thread, fp32
      (what `auto` picks on a CPU; bf16 is the yaml's choice for CUDA);
    - the tiny test model instead of a FLUX VAE folder;
    - replicas import the checkout (tests/, deploy/) and run without Ray's token auth;
    - autoscaling on a test's time scale (seconds, not minutes), at most the nodes there can be,
      with the yaml's policy (docs/autoscaling.md) and its wait and backlog targets on that scale too;
      the same for the replicas' body deadline.
    """
    raw = yaml.safe_load((DEPLOY / "serve-gpu.yaml").read_text())
    raw["proxy_location"] = "HeadOnly"
    raw["http_options"].update(host="127.0.0.1", port=http_port)
    raw["grpc_options"]["port"] = grpc_port
    (app,) = raw["applications"]
    assert app["name"] == APP
    app["runtime_env"] = {"env_vars": {"PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}}
    app["args"].update(model=str(model), model_name="kl", device="cpu", decode_precision="fp32", cpu_threads=1)
    # the replicas' own body deadline on the test's time scale: shorter than Ray takes to declare a
    # lost node dead, as the default 30 s often is in production (the proxy guard keeps its 30 s)
    app["args"].setdefault("limits", {})["body_timeout_s"] = 3
    app["args"].update(args)
    (deployment,) = app["deployments"]
    assert deployment["name"] == DEPLOYMENT
    actor = deployment["ray_actor_options"]
    assert actor.pop("num_gpus") == 1
    actor.update(num_cpus=1, resources={SLOT: 1})
    scaling = deployment["autoscaling_config"]
    scaling.update(
        max_replicas=3,  # deploy/fake-cluster.yaml: at most 3 worker nodes
        target_ongoing_requests=2,  # what Serve's default policy would use (ours ignores it)
        upscale_delay_s=1,
        downscale_delay_s=2,
        look_back_period_s=2,
        metrics_interval_s=0.5,
    )
    # the yaml's own policy, its targets on this time scale: a tiny model's decode takes milliseconds
    # on one CPU thread, so any wait behind another batch is late and a second of queued bulk work a backlog
    assert scaling["policy"]["policy_function"].endswith(":DecoderScalingPolicy")
    scaling["policy"]["policy_kwargs"].update(TEST_POLICY_TARGETS)
    return raw


TEST_POLICY_TARGETS = {"realtime_wait_ms": 2, "interactive_wait_ms": 2, "bulk_backlog_s": 1}


class FakeCluster:
    """A head (no CPU: Serve's controller and proxy) and 0-3 worker nodes the autoscaler adds and
    removes, all under one temp dir of our own."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model = root, model
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.http_port, self.grpc_port = free_port(), free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.spawned: list[subprocess.Popen] = []  # `ray start`, while it runs
        self._http = httpx.Client(timeout=10)

    # ---- life -------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        (app,) = yaml.safe_load((DEPLOY / "serve-gpu.yaml").read_text())["applications"]
        config = ServiceConfig.model_validate(app["args"])
        env.update(
            proxy_guard_env(config),  # the proxy guard, from the application's own config (as on KubeRay)
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            RAY_AUTH_MODE="disabled",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            RAY_USAGE_STATS_ENABLED="0",
            # a lost node is declared dead within ~10 s (Ray's default: up to ~30 s)
            RAY_health_check_period_ms="1000",
            RAY_health_check_failure_threshold="10",
            # metrics exported every second: a replica's last gauge (its folded bytes released)
            # reaches its node's endpoint before the replica and its node go
            RAY_metrics_report_interval_ms="1000",
        )
        return env

    def start(self) -> None:
        cluster = yaml.safe_load((DEPLOY / "fake-cluster.yaml").read_text())
        ip = subprocess.run(
            [sys.executable, "-c", "import ray._private.services as s; print(s.get_node_ip_address())"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        # workers join this GCS (the provider's default is port 6379, which other clusters may hold)
        cluster["provider"]["gcs_address"] = f"{ip}:{self.gcs_port}"
        config = self.root / "cluster.yaml"
        config.write_text(yaml.safe_dump(cluster))
        command = [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={self.gcs_port}",
            f"--autoscaling-config={config}",
            "--num-cpus=0",
            f"--temp-dir={self.root}",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
        ]
        proc = subprocess.Popen(
            command, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.spawned.append(proc)
        out, _ = proc.communicate(timeout=180)  # on a timeout, stop() ends it with the rest
        assert proc.returncode == 0, f"ray start failed:\n{out[-4000:]}"
        wait_for("the dashboard", lambda: self._http.get(f"{self.dashboard}/api/version").status_code == 200, 60)

    def deploy(self, config: dict) -> None:
        path = self.root / f"serve-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        result = subprocess.run(
            [str(BIN / "serve"), "deploy", str(path), "--address", self.dashboard],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"serve deploy failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    def pids(self) -> set[int]:
        """Every live process of this cluster: command line or an open file under our temp dir,
        `ray start` while it runs, and the descendants of any of them."""
        root, parents = str(self.root), _parents()
        mine = {proc.pid for proc in self.spawned if proc.poll() is None}  # not yet reaped: still that process
        for pid in parents:
            if pid == os.getpid():
                continue  # never this process (nor what it started besides the cluster)
            if root in _cmdline(pid):
                mine.add(pid)
                continue
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd).startswith(root):
                            mine.add(pid)
                            break
        return _with_descendants(mine, parents)

    def stop(self) -> None:
        self._http.close()
        for sig, grace_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while pids and time.monotonic() < deadline:
                pids = {pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)}
                time.sleep(0.2)
        left = self.pids()
        assert not left, f"cluster processes still alive after SIGKILL: {sorted(left)}"

    # ---- state ------------------------------------------------------------------------------
    def _state(self, kind: str, **filters: str) -> list[dict]:
        params = [("limit", "1000"), ("detail", "true")]
        for key, value in filters.items():
            params += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", value)]
        r = self._http.get(f"{self.dashboard}/api/v0/{kind}", params=params)
        r.raise_for_status()
        return r.json()["data"]["result"]["result"]

    def worker_nodes(self) -> set[str]:
        """Alive worker nodes (ids)."""
        return {
            n["node_id"]
            for n in self._state("nodes", state="ALIVE")
            if not n.get("is_head_node") and n["resources_total"].get(SLOT)
        }

    def _app(self) -> dict | None:
        r = self._http.get(f"{self.dashboard}/api/serve/applications/")
        r.raise_for_status()
        return r.json().get("applications", {}).get(APP)

    def app_status(self) -> str | None:
        app = self._app()
        return app and app["status"]

    def replica_details(self) -> list[dict]:
        """Serve's view of the decoder's replicas (replica_id, state, node_id, log_file_path...)."""
        app = self._app()
        return app["deployments"][DEPLOYMENT]["replicas"] if app and DEPLOYMENT in app["deployments"] else []

    def replicas(self) -> dict[str, str]:
        """RUNNING replicas of the decoder: replica id (as /health names it) -> node id."""
        return {r["replica_id"]: r["node_id"] for r in self.replica_details() if r["state"] == "RUNNING"}

    def log(self, path: str) -> Path:
        """A log file of the cluster's (Serve's `log_file_path`: under the session's logs)."""
        return self.root / "session_latest" / "logs" / path.lstrip("/")

    def node_pids(self, node_id: str) -> list[int]:
        """A worker node's processes: its raylet first, then what the raylet started (its workers,
        replicas among them, and agents)."""
        (raylet,) = [
            pid
            for pid in self.pids()
            if _cmdline(pid).split(" ", 1)[0].endswith("/raylet") and f"--node_id={node_id} " in _cmdline(pid)
        ]
        return [raylet, *sorted(_with_descendants({raylet}, _parents()) - {raylet})]

    def metrics(self, family: str) -> dict[str, float]:
        """`family`'s samples on every node's Prometheus endpoint (Ray's own service discovery
        file, what a Prometheus server would scrape): 'name{labels}' -> value."""
        try:
            discovery = yaml.safe_load((self.root / "prom_metrics_service_discovery.json").read_text()) or []
        except (OSError, yaml.YAMLError):  # not written yet, or being rewritten
            discovery = []
        found = {}
        for target in [t for group in discovery for t in group["targets"]]:
            try:
                text = self._http.get(f"http://{target}/metrics", timeout=5).text
            except httpx.HTTPError:
                continue  # a node going away
            for line in text.splitlines():
                if line.startswith(family + "{"):
                    name, value = line.rsplit(" ", 1)
                    found[name] = float(value)
        return found


def _parents() -> dict[int, int]:
    """Every process's parent: pid -> ppid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit():
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def _with_descendants(pids: set[int], parents: dict[int, int]) -> set[int]:
    pids, grown = set(pids), True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in pids} - pids
        grown = bool(children)
        pids |= children
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.fixture(scope="package")
def fake_cluster(kl_dir) -> Iterator[FakeCluster]:
    """One cluster for tests/cluster's modules (each test deploys what it needs), gone once they ran:
    it must not idle through the rest of the session."""
    # a short path: Ray's unix sockets live under it (108 bytes at most)
    root = Path(tempfile.mkdtemp(prefix="vae-fc-", dir="/tmp"))
    cluster = FakeCluster(root, kl_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)
