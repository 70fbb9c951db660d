"""One local Ray cluster and one Serve instance for the whole session (Ray's own test pattern)."""

import os
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.s3 import S3_ENV
from vae_service.config import ServiceConfig
from vae_service.serving.app import GRPC_SERVICER
from vae_service.serving.wire.proxy_guard import proxy_guard_env

pytestmark = pytest.mark.integration
PORTS: dict[str, int] = {}
PROXY_BODY_TIMEOUT_S = 3.0
TEST_DEPLOYMENT = dict(graceful_shutdown_wait_loop_s=0.05, graceful_shutdown_timeout_s=0.5)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # the proxy guard, installed the way the CLI installs it (with a shorter body deadline)
    os.environ.update(proxy_guard_env(ServiceConfig(limits={"body_timeout_s": PROXY_BODY_TIMEOUT_S})))
    repo = str(Path(__file__).resolve().parents[2])  # replicas import deploy/ modules from the checkout
    PORTS["metrics"] = free_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _metrics_export_port=PORTS["metrics"],
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "RAY_AUTH_MODE": "disabled",
                "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
                # the test store's dummy credentials (tests/s3.py), as replicas and batch engines read them
                **S3_ENV,
            }
        },
    )
    # serve.run and serve.delete wait for the controller by asking it once a second: half a second
    # lost on average per call, ~70 calls a run. The local controller answers in about a
    # millisecond, so it is asked every 50 ms instead (a private constant of Ray 2.60's client).
    from ray.serve._private import client as serve_client

    assert serve_client.CLIENT_POLLING_INTERVAL_S == 1.0, "Ray's Serve client changed: revisit this"
    serve_client.CLIENT_POLLING_INTERVAL_S = 0.05
    from ray.serve.config import gRPCOptions

    port = free_port()
    PORTS["grpc"] = free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        grpc_options=gRPCOptions(port=PORTS["grpc"], grpc_servicer_functions=[GRPC_SERVICER]),
    )
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def kl_url(ray_cluster, kl_dir):
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {
        "model": str(kl_dir),
        "model_name": "kl",
        "cpu_threads": 1,
        "limits": {"max_request_bytes": 4 * 2**20, "max_output_pixels": 2**22},
    }
    serve.run(decoder_app(config, **TEST_DEPLOYMENT), name="kl", route_prefix="/kl")
    return f"{ray_cluster}/kl"


@pytest.fixture(scope="session")
def wan_url(ray_cluster, wan_dir):
    """A video model as its own HTTP ingress (streaming without a router in front)."""
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {"model": str(wan_dir), "model_name": "wan", "cpu_threads": 1}
    serve.run(decoder_app(config, **TEST_DEPLOYMENT), name="wan", route_prefix="/wan")
    return f"{ray_cluster}/wan"


@pytest.fixture(scope="session")
def multi_url(ray_cluster, kl_dir, flux_dir, wan_dir):
    """One ingress, three models: routing by `model`."""
    from ray import serve

    from vae_service.serving.app import multi_model_app

    models = [
        {"model": str(folder), "model_name": name, "cpu_threads": 1}
        for name, folder in (("kl", kl_dir), ("flux", flux_dir), ("wan", wan_dir))
    ]
    serve.run(multi_model_app({"models": models}, **TEST_DEPLOYMENT), name="multi", route_prefix="/multi")
    return f"{ray_cluster}/multi"


@pytest.fixture(scope="session")
def hasty_url(ray_cluster, kl_dir):
    """tiny-kl whose requests time out almost at once (request_timeout_s 0.05): one deployment for
    the 504 over HTTP (test_batching_lifecycle.py) and DEADLINE_EXCEEDED over gRPC (test_grpc.py,
    application `hasty`)."""
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {"model": str(kl_dir), "model_name": "hasty", "cpu_threads": 1, "batching": {"request_timeout_s": 0.05}}
    # no CPU reserved: the session's apps hold as many of the cluster's 8 as before it was shared
    options = dict(TEST_DEPLOYMENT, ray_actor_options={"num_cpus": 0})
    serve.run(decoder_app(config, **options), name="hasty", route_prefix="/hasty")
    return f"{ray_cluster}/hasty"


@pytest.fixture(scope="session")
def metrics_url(ray_cluster):
    return f"http://127.0.0.1:{PORTS['metrics']}/metrics"


@pytest.fixture(scope="session")
def grpc_target(ray_cluster):
    return f"127.0.0.1:{PORTS['grpc']}"


@pytest.fixture
def app(ray_cluster, kl_dir):
    """Deploys tiny-kl apps with a config of the test's own; deletes them afterwards."""
    from ray import serve

    from vae_service.serving.app import decoder_app

    names = []

    def deploy(name, autoscaling_config=None, app_name=None, **config):
        """`name` is the served model's name; `app_name` (default: the same) the application's."""
        options = dict(TEST_DEPLOYMENT, **({"autoscaling_config": autoscaling_config} if autoscaling_config else {}))
        app_name = app_name or name
        serve.run(
            decoder_app({"model": str(kl_dir), "model_name": name, "cpu_threads": 1, **config}, **options),
            name=app_name,
            route_prefix=f"/{app_name}",
        )
        names.append(app_name)
        return f"{ray_cluster}/{app_name}"

    yield deploy
    for name in names:
        serve.delete(name)


# Decode sessions (tests/session_wire.py speaks their wire). Sessions here never expire by
# themselves during a test (idle_timeout_s 300): what frees one is the test's own act (a close, a
# disconnect, a killed replica). Expiry has its own one-replica application below.
SESSIONS_CONFIG = {
    "model_name": "wan",
    "cpu_threads": 1,
    "limits": {"max_sessions": 3, "max_session_chunk_frames": 4},
    # 2 x 3 decode slots per replica, of which at most 4 hold session connections
    "batching": {"batch_wait_ms": 30, "max_batch_size": 2},
    "serving": {"concurrent_keys": 3},
}
SESSION_SLOTS, SESSION_CONNECTIONS = 6, 4


def _sessions_app(name: str, wan_dir, replicas: int, **config):
    from ray import serve

    from vae_service.serving.app import decoder_app

    options = dict(TEST_DEPLOYMENT, num_replicas=replicas, ray_actor_options={"num_cpus": 0})
    serve.run(decoder_app({**SESSIONS_CONFIG, "model": str(wan_dir), **config}, **options), name=name,
              route_prefix=f"/{name}-app")  # fmt: skip


@pytest.fixture(scope="session")
def sessions_app(ray_cluster, wan_dir):
    """tiny Wan, two replicas, at most 3 sessions per replica, sessions that outlive any test."""
    _sessions_app(
        "sessions", wan_dir, 2,
        sessions={"idle_timeout_s": 300, "open_timeout_s": 30, "max_connections": SESSION_CONNECTIONS},
    )  # fmt: skip
    return f"{ray_cluster}/sessions-app"


@pytest.fixture(scope="session")
def expiring_sessions_app(ray_cluster, wan_dir):
    """tiny Wan, one replica, sessions idle for 1.5 s expire; a connection that sends no open is
    closed after 4 s, as is an expired session's that sends nothing in the 4 s after its expiry."""
    _sessions_app("expiring", wan_dir, 1, sessions={"idle_timeout_s": 1.5, "open_timeout_s": 4})
    return f"{ray_cluster}/expiring-app"
