"""Batching, backpressure, timeouts, live reconfigure and scaling on the real local Serve."""

import asyncio
import glob
import os
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from ray import serve

from tests.models import at_precision, reference_decode, torch_threads
from vae_service.serving.app import decoder_app
from vae_service_client import AsyncVaeClient, VaeClient, VaeServiceError
from vae_service_client.messages import pack, request_map

pytestmark = pytest.mark.integration
FP32_MAX_ABS = 1e-3  # high vs lossless, as in tests/unit/test_fastpath.py


async def test_mixed_tier_load_is_answered_exactly_once_and_correctly(kl_url, kl_reference):
    gen = torch.Generator().manual_seed(21)
    jobs = [
        (f"r{i}", "lossless" if i % 3 else "high", torch.randn(1 + i % 2, 4, 5, 6, generator=gen)) for i in range(24)
    ]
    async with AsyncVaeClient(kl_url) as client:
        threads = (await client.health())["cpu_threads"]
        responses = await asyncio.gather(
            *(client.decode(z, quality=q, output="float", scaling_factor=None, request_id=rid) for rid, q, z in jobs)
        )
    assert sorted(r.request_id for r in responses) == sorted(rid for rid, _, _ in jobs)
    assert max(r.timing["batch_size"] for r in responses) > 2  # requests were batched together
    for (rid, quality, z), resp in zip(jobs, responses, strict=True):
        assert resp.request_id == rid and resp.quality == quality
        with torch_threads(threads):
            solo = reference_decode(kl_reference, z).numpy()
        if quality == "lossless":
            np.testing.assert_array_equal(resp.output, solo)
        else:
            assert np.abs(resp.output - solo).max() <= FP32_MAX_ABS


@pytest.mark.parametrize("configured, status", [(None, 429), (503, 503)], ids=["default-429", "configured-503"])
async def test_overload_gets_the_configured_status_with_retry_after_and_never_500(app, configured, status):
    chosen = {} if configured is None else {"backpressure_status": configured}  # None: the documented default
    url = app(
        f"tight{status}",
        batching={"max_batch_size": 1, "batch_wait_ms": 0, "max_queued_items": 2},
        serving={"concurrent_keys": 1, "max_queued_requests": 2, "retry_after_s": 2, **chosen},
    )
    z = torch.randn(1, 4, 48, 48)  # ~0.3 s per decode here
    async with httpx.AsyncClient(timeout=120) as http:
        body = pack(request_map(z))
        rs = await asyncio.gather(
            *(
                http.post(f"{url}/decode", content=body, headers={"content-type": "application/msgpack"})
                for _ in range(16)
            )
        )
    codes = [r.status_code for r in rs]
    assert 500 not in codes and set(codes) <= {200, status}
    assert codes.count(200) >= 1 and codes.count(status) >= 1
    assert all(r.headers.get("retry-after") == "2" for r in rs if r.status_code == status)


def test_request_timeout_is_a_504_not_a_hang(hasty_url):
    with VaeClient(hasty_url) as client:
        with pytest.raises(VaeServiceError) as err:
            client.decode(torch.randn(1, 4, 64, 64))
        assert err.value.status == 504 and err.value.type == "timeout"

        def small_decode_succeeds():  # once the abandoned decode has left the device
            try:
                return client.decode(torch.randn(1, 4, 1, 1)).output.shape == (1, 8, 8, 3)
            except VaeServiceError as exc:
                assert exc.status == 504
                return False

        _wait(small_decode_succeeds, timeout_s=60, every=0.1)


def _replica_logs(replica_id):
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    return glob.glob(os.path.join(session, "logs", "serve", f"*{replica_id}*.log"))


def _wait(predicate, timeout_s=60, every=0.1):
    end = time.time() + timeout_s
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


def test_autoscaling_1_2_1_and_the_removed_replica_releases_its_folded_buffers(app):
    url = app(
        "scale",
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 2,
            "initial_replicas": 1,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 3,
            "look_back_period_s": 1,
            "metrics_interval_s": 0.5,  # load reported twice a second (default: every 10 s)
        },
        batching={"max_batch_size": 1},
    )
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
            match = re.search(r"released (\d+) bytes of folded buffers", Path(path).read_text())
            if match:
                return int(match.group(1))
        return None

    assert _wait(released_bytes, timeout_s=30) == seen[removed] > 0


def _running_replicas(app_name):
    status = serve.status().applications[app_name].deployments["VaeDecoder"]
    return status.replica_states.get("RUNNING", 0)


async def test_a_precision_change_rolls_replicas_without_failing_a_request(ray_cluster, kl_dir, kl_reference):
    """Precision is a deployment argument: redeploying with another rolls replicas through Serve.
    Requests in flight meanwhile all succeed (no retries), and each lossless reply is bit-identical
    to the solo decode at the precision it names."""
    name = "roll"
    options = dict(graceful_shutdown_wait_loop_s=0.05, graceful_shutdown_timeout_s=30)

    def deploy(precision):
        serve.run(
            decoder_app(
                {"model": str(kl_dir), "model_name": name, "cpu_threads": 1, "decode_precision": precision}, **options
            ),
            name=name,
            route_prefix=f"/{name}",
        )

    deploy("fp32")
    gen = torch.Generator().manual_seed(31)
    latents = [torch.randn(1, 4, 3, 4, generator=gen) for _ in range(4)]
    replies, stop = [], asyncio.Event()

    async def load(worker: int):
        async with AsyncVaeClient(f"{ray_cluster}/{name}", retries=0) as client:
            i = worker
            while not stop.is_set():
                z = latents[i % len(latents)]
                replies.append((z, await client.decode(z, output="float", scaling_factor=None)))
                i += 1

    try:
        workers = [asyncio.create_task(load(w)) for w in range(3)]
        while len(replies) < 6:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(deploy, "bf16")
        seen_bf16 = len(replies)
        while sum(r.precision == "bf16" for _, r in replies[seen_bf16:]) < 6:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*workers)  # a failed request would raise here
    finally:
        stop.set()
        serve.delete(name)
    assert {r.precision for _, r in replies} == {"fp32", "bf16"}
    references = {}
    with torch_threads(1):
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            vae = at_precision(kl_reference, dtype)
            references[precision] = {id(z): reference_decode(vae, z.to(dtype)).float().numpy() for z in latents}
    for z, reply in replies:
        np.testing.assert_array_equal(reply.output, references[reply.precision][id(z)])
