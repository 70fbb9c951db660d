"""One local Ray cluster and one Serve instance for the whole session (Ray's own test pattern)."""

import os
import socket

import pytest

pytestmark = pytest.mark.integration

TEST_DEPLOYMENT = dict(graceful_shutdown_wait_loop_s=0.05, graceful_shutdown_timeout_s=0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def kl_url(ray_cluster, kl_dir):
    from ray import serve

    from vae_service.serving.app import build_app

    config = {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1,
              "limits": {"max_request_bytes": 4 * 2**20, "max_output_pixels": 2**22}}
    serve.run(build_app(config, **TEST_DEPLOYMENT), name="kl", route_prefix="/kl")
    return f"{ray_cluster}/kl"
