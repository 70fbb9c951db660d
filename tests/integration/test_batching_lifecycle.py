"""Batching, backpressure, timeouts, live reconfigure and scaling on the real local Serve."""

import asyncio
import glob
import os
import re
import time

import httpx
import numpy as np
import pytest
import torch
from ray import serve

from tests.integration.conftest import TEST_DEPLOYMENT
from tests.models import reference_decode, torch_threads
from vae_service.serving.app import build_app
from vae_service_client import AsyncVaeClient, VaeClient, VaeServiceError

pytestmark = pytest.mark.integration
FP32_MAX_ABS = 1e-3  # high vs lossless, as in tests/unit/test_fastpath.py


async def test_mixed_tier_load_is_answered_exactly_once_and_correctly(kl_url, kl_vae):
    gen = torch.Generator().manual_seed(21)
    jobs = [(f"r{i}", "lossless" if i % 3 else "high", torch.randn(1 + i % 2, 4, 5, 6, generator=gen)) for i in range(24)]
    async with AsyncVaeClient(kl_url) as client:
        threads = (await client.health())["cpu_threads"]
        responses = await asyncio.gather(*(client.decode(z, quality=q, output="float", scaling_factor=None,
                                                         request_id=rid) for rid, q, z in jobs))
    assert sorted(r.request_id for r in responses) == sorted(rid for rid, _, _ in jobs)
    assert max(r.timing["batch_size"] for r in responses) > 2  # requests were batched together
    for (rid, quality, z), resp in zip(jobs, responses):
        assert resp.request_id == rid and resp.quality == quality
        with torch_threads(threads):
            solo = reference_decode(kl_vae, z).numpy()
        if quality == "lossless":
            np.testing.assert_array_equal(resp.output, solo)
        else:
            assert np.abs(resp.output - solo).max() <= FP32_MAX_ABS


def _deploy(name, kl_dir, autoscaling_config=None, **config):
    options = dict(TEST_DEPLOYMENT, **({"autoscaling_config": autoscaling_config} if autoscaling_config else {}))
    serve.run(build_app({"model": str(kl_dir), "model_name": name, "cpu_threads": 1, **config}, **options),
              name=name, route_prefix=f"/{name}")


@pytest.fixture
def app(ray_cluster, kl_dir):
    names = []

    def deploy(name, **config):
        _deploy(name, kl_dir, **config)
        names.append(name)
        return f"{ray_cluster}/{name}"

    yield deploy
    for name in names:
        serve.delete(name)


async def test_overload_gets_429_with_retry_after_and_never_500(app):
    url = app("tight", batching={"max_batch_size": 1, "batch_wait_ms": 0, "max_queued_items": 2},
              serving={"concurrent_keys": 1, "max_queued_requests": 2, "retry_after_s": 2})
    z = torch.randn(1, 4, 48, 48)  # ~0.3 s per decode here
    async with httpx.AsyncClient(timeout=120) as http:
        from vae_service_client.wire import decode_body

        body = decode_body(z)
        rs = await asyncio.gather(*(http.post(f"{url}/decode", content=body,
                                              headers={"content-type": "application/msgpack"}) for _ in range(16)))
    codes = [r.status_code for r in rs]
    assert 500 not in codes and set(codes) <= {200, 429}
    assert codes.count(200) >= 1 and codes.count(429) >= 1
    assert all(r.headers.get("retry-after") == "2" for r in rs if r.status_code == 429)


def test_request_timeout_is_a_504_not_a_hang(app):
    url = app("hasty", batching={"request_timeout_s": 0.05})
    with VaeClient(url) as client:
        with pytest.raises(VaeServiceError) as err:
            client.decode(torch.randn(1, 4, 64, 64))
        assert err.value.status == 504 and err.value.type == "timeout"

        def small_decode_succeeds():  # once the abandoned decode has left the device
            try:
                return client.decode(torch.randn(1, 4, 1, 1)).output.shape == (1, 8, 8, 3)
            except VaeServiceError as exc:
                assert exc.status == 504
                return False

        _wait(small_decode_succeeds, timeout_s=60, every=0.5)


def _replica_logs(replica_id):
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    return glob.glob(os.path.join(session, "logs", "serve", f"*{replica_id}*.log"))


def _wait(predicate, timeout_s=60, every=0.5):
    end = time.time() + timeout_s
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


def test_autoscaling_1_2_1_and_the_removed_replica_releases_its_folded_buffers(app):
    url = app("scale", autoscaling_config={"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                                           "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                                           "downscale_delay_s": 3, "look_back_period_s": 1},
              batching={"max_batch_size": 1})
    seen = {}

    async def load_until_two_replicas_hold_folds():
        async with AsyncVaeClient(url) as client:
            for _ in range(120):
                await asyncio.gather(*(client.decode(torch.randn(1, 4, 24, 24), quality="high") for _ in range(6)))
                for _ in range(4):
                    h = await client.health()
                    seen[h["replica"]] = h["fast_path"]["folded_bytes"]
                if len(seen) == 2 and all(v > 0 for v in seen.values()):
                    return
        raise AssertionError(f"never saw two replicas with folded buffers: {seen}")

    asyncio.run(load_until_two_replicas_hold_folds())
    _wait(lambda: _running_replicas("scale") == 1, timeout_s=60)  # idle: back down to one
    remaining = {VaeClient(url).health()["replica"] for _ in range(5)}
    (removed,) = set(seen) - remaining

    def released_bytes():
        for path in _replica_logs(removed):
            match = re.search(r"released (\d+) bytes of folded buffers", open(path).read())
            if match:
                return int(match.group(1))
        return None

    assert _wait(released_bytes, timeout_s=30) == seen[removed] > 0


def _running_replicas(app_name):
    status = serve.status().applications[app_name].deployments["VaeDecoder"]
    return status.replica_states.get("RUNNING", 0)
