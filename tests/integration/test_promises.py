"""README promises on the real local Serve: drain on shutdown, bf16 answers on every interface,
a client that gives up is never decoded, clients' retries against a real overload, the handle
API's encoded outputs and release_folded."""

import asyncio
import contextlib
import io
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from ray import serve

from tests.models import at_precision, reference_decode, torch_threads
from vae_service_client import AsyncVaeClient, VaeClient, VaeGrpcClient, retries
from vae_service_client.messages import MSGPACK, pack, request_map

pytestmark = pytest.mark.integration
SLOW = torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(0))  # ~0.3-0.5 s per decode here


async def test_requests_queued_and_running_when_a_replica_is_removed_all_complete(ray_cluster, kl_dir, kl_reference):
    from vae_service.serving.app import decoder_app

    config = {
        "model": str(kl_dir),
        "model_name": "drain",
        "cpu_threads": 1,
        "batching": {"max_batch_size": 1},
        "serving": {"concurrent_keys": 16},
    }  # room for every request and the health probes
    serve.run(
        decoder_app(config, graceful_shutdown_timeout_s=60, graceful_shutdown_wait_loop_s=0.05),
        name="drain",
        route_prefix="/drain",
    )
    url = f"{ray_cluster}/drain"
    gen = torch.Generator().manual_seed(12)
    latents = [torch.randn(1, 4, 64, 64, generator=gen) for _ in range(8)]
    async with AsyncVaeClient(url, retries=0) as client:
        health = await client.health()
        tasks = [asyncio.create_task(client.decode(z, output="float", scaling_factor=None)) for z in latents]
        health = await client.health()
        deadline = time.monotonic() + 60
        while not (health["running_batches"] and health["queued_items"] >= 2):  # one running, several queued
            assert time.monotonic() < deadline, f"never saw work running and queued: {health}"
            await asyncio.sleep(0.01)
            health = await client.health()
        deleting = asyncio.create_task(asyncio.to_thread(serve.delete, "drain"))
        replies = await asyncio.gather(*tasks)
        await deleting
    with torch_threads(health["cpu_threads"]):
        for z, reply in zip(latents, replies, strict=True):
            np.testing.assert_array_equal(reply.output, reference_decode(kl_reference, z).numpy())


@pytest.fixture(scope="module")
def bf16_app(ray_cluster, kl_dir):
    from vae_service.serving.app import decoder_app

    serve.run(
        decoder_app(
            {"model": str(kl_dir), "model_name": "kl16", "cpu_threads": 1, "decode_precision": "bf16"},
            graceful_shutdown_timeout_s=0.5,
        ),
        name="kl16",
        route_prefix="/kl16",
    )
    yield f"{ray_cluster}/kl16"
    serve.delete("kl16")


def test_bf16_answers_are_exact_through_http_grpc_and_handles(bf16_app, grpc_target, kl_reference):
    z = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(6))
    with torch_threads(1):
        expected = reference_decode(at_precision(kl_reference, torch.bfloat16), z.to(torch.bfloat16)).float().numpy()
    with VaeClient(bf16_app) as client:
        http = client.decode(z, output="float", scaling_factor=None)
    with VaeGrpcClient(grpc_target, application="kl16") as client:
        grpc = client.decode(z, output="float", scaling_factor=None)
    handle = serve.get_app_handle("kl16").decode.remote(z, output="float", scaling_factor=None).result()
    for precision, output in (
        (http.precision, http.output),
        (grpc.precision, grpc.output),
        (handle["precision"], handle["output"]),
    ):
        assert precision == "bf16" and output.dtype == np.float32  # numpy has no bf16: widened exactly
        np.testing.assert_array_equal(output, expected)


async def test_a_client_that_goes_away_before_its_batch_runs_is_never_decoded(app):
    url = app("leave", batching={"max_batch_size": 1})
    async with AsyncVaeClient(url) as client:
        before = (await client.health())["decoded_items"]
        busy = asyncio.create_task(client.decode(SLOW))  # holds the device
        while (await client.health())["running_batches"] == 0:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.05)) as impatient:
            with pytest.raises(httpx.ReadTimeout):  # queued behind the busy decode, then gone
                await impatient.post(
                    f"{url}/decode",
                    content=pack(request_map(torch.zeros(1, 4, 2, 2))),
                    headers={"content-type": MSGPACK},
                )
        await busy
        # the replica goes idle (a request still queued would be decoded first): nothing was left
        # queued for the client that went away, nor decoded for it
        deadline = time.monotonic() + 30
        while (health := await client.health())["queued_items"] or health["running_batches"]:
            assert time.monotonic() < deadline, f"the replica never went idle: {health}"
            await asyncio.sleep(0.02)
    assert health["queued_items"] == 0 and health["decoded_items"] == before + 1


def _decode_against_an_overload(url: str, slept: list) -> object:
    """Keep the service full (one decoding, one queued, more knocking), then decode with retries;
    the overload ends once the client backs off."""
    stop = threading.Event()

    def backing_off(seconds: float) -> None:
        slept.append(seconds)
        stop.set()
        time.sleep(seconds)

    def block():
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():  # a freed slot is taken again at once
                http.post(f"{url}/decode", content=pack(request_map(SLOW)), headers={"content-type": MSGPACK})

    blockers = [threading.Thread(target=block) for _ in range(4)]
    for t in blockers:
        t.start()
    try:
        with httpx.Client(timeout=120) as http:  # until the service turns requests away
            tiny = pack(request_map(torch.zeros(1, 4, 2, 2)))
            while http.post(f"{url}/decode", content=tiny, headers={"content-type": MSGPACK}).status_code != 429:
                pass
        with VaeClient(url, retries=8, backoff_s=0.05) as client, _sleeping(backing_off):
            return client.decode(torch.zeros(1, 4, 2, 2))
    finally:
        stop.set()
        for t in blockers:
            t.join()


@contextlib.contextmanager
def _sleeping(sleep):
    """The clients' retry waits go through `sleep` (recorded), nothing else's."""
    real = retries.time
    retries.time = SimpleNamespace(sleep=sleep)
    try:
        yield
    finally:
        retries.time = real


def test_clients_retry_a_real_overload_honouring_retry_after(app):
    url = app(
        "busy",
        batching={"max_batch_size": 1},
        serving={"concurrent_keys": 1, "max_queued_requests": 1, "retry_after_s": 1},
    )
    for _ in range(3):  # the client's first try can land in the instant a slot frees: then again
        slept = []
        reply = _decode_against_an_overload(url, slept)
        assert reply.output.shape == (1, 16, 16, 3)
        if slept:
            break
    assert slept and all(s >= 1.0 for s in slept)  # every wait honoured Retry-After: 1 over the 0.05 s backoff


def test_handle_api_encoded_outputs_and_release_folded(kl_url):
    handle = serve.get_app_handle("kl")
    z = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(13))
    pngs = handle.decode.remote(z, output="png").result()["output"]
    pixels = VaeClient(kl_url).decode(z).output
    assert isinstance(pngs, list) and len(pngs) == 2
    np.testing.assert_array_equal(np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in pngs]), pixels)
    handle.decode.remote(z, quality="high").result()
    held = VaeClient(kl_url).health()["fast_path"]["folded_bytes"]
    assert held > 0
    assert handle.release_folded.remote().result() == held
    assert VaeClient(kl_url).health()["fast_path"]["folded_bytes"] == 0
