"""Faults on the real local Serve: slow and oversized bodies cut off in front of the replicas,
a replica killed with requests in flight (503 + Retry-After, never 500; back within 30 s), the
same behind the routing ingress."""

import asyncio
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
import ray
import torch
from ray import serve

from tests.integration.conftest import PROXY_BODY_TIMEOUT_S, TEST_DEPLOYMENT
from vae_service.serving.app import decoder_app, multi_model_app
from vae_service_client.messages import MSGPACK, pack, request_map

pytestmark = pytest.mark.integration


def raw_post(url: str, headers: dict[str, str], body_bytes_every: float | None, body_len: int) -> tuple[int, float]:
    """POST over a plain socket: headers, then (optionally) one body byte every `body_bytes_every` s.
    Returns the status line's code and the seconds until it came."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Length: {body_len}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        start = time.monotonic()
        sock.sendall(head.encode())
        sock.setblocking(False)
        sent, received = 0, b""
        while b"\r\n" not in received:
            if body_bytes_every is not None and sent < body_len:
                sock.sendall(b"\x00")
                sent += 1
            deadline = time.monotonic() + (body_bytes_every or 60)
            while time.monotonic() < deadline and b"\r\n" not in received:
                try:
                    received += sock.recv(4096)
                except BlockingIOError:
                    time.sleep(0.01)
        return int(received.split()[1]), time.monotonic() - start


def test_a_slow_body_is_cut_off_with_408_at_the_deadline(kl_url):
    status, took = raw_post(f"{kl_url}/decode", {"content-type": MSGPACK}, body_bytes_every=1.0, body_len=1000)
    assert status == 408
    assert PROXY_BODY_TIMEOUT_S <= took < PROXY_BODY_TIMEOUT_S + 10  # at the deadline, not at the body's end


def _kill_replicas(app_name: str, deployment: str) -> int:
    killed = 0
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app_name}#{deployment}#"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            killed += 1
    return killed


async def _decoding_with_more_queued(http: httpx.AsyncClient, url: str) -> None:
    """Returns once the decoder says a batch is running and more items wait behind it (its own
    /health, or the router's entry for it), so the kill lands on requests in flight. /health may
    itself queue behind the decodes in Serve (the replica's slots are full): it answers as soon as
    one frees."""
    deadline = time.monotonic() + 60
    while True:
        health = (await http.get(f"{url}/health")).json()
        (decoder,) = health["models"].values() if "models" in health else (health,)
        if decoder["running_batches"] and decoder["queued_items"]:
            return
        assert time.monotonic() < deadline, f"never saw a batch running with more queued: {decoder}"
        await asyncio.sleep(0.02)


async def _load_through_a_kill(url: str, app_name: str, deployment: str) -> list[httpx.Response]:
    body = pack(request_map(torch.randn(1, 4, 48, 48, generator=torch.Generator().manual_seed(0))))
    async with httpx.AsyncClient(timeout=120) as http:
        requests = [
            asyncio.create_task(http.post(f"{url}/decode", content=body, headers={"content-type": MSGPACK}))
            for _ in range(16)
        ]
        await _decoding_with_more_queued(http, url)
        assert await asyncio.to_thread(_kill_replicas, app_name, deployment) >= 1
        return await asyncio.gather(*requests)


def _back_within(url: str, seconds: float) -> float:
    body = pack(request_map(torch.zeros(1, 4, 2, 2)))
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if (
                httpx.post(f"{url}/decode", content=body, headers={"content-type": MSGPACK}, timeout=10).status_code
                == 200
            ):
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the service did not answer within {seconds} s of the kill")


@pytest.mark.parametrize("ingress", ["replica", "router"])
def test_a_replica_killed_mid_load_answers_503_with_retry_after_never_500(ray_cluster, kl_dir, ingress):
    name = f"doomed-{ingress}"
    config = {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1, "batching": {"max_batch_size": 2}}
    app = (
        decoder_app(config, **TEST_DEPLOYMENT)
        if ingress == "replica"
        else multi_model_app({"models": [config]}, **TEST_DEPLOYMENT)
    )
    serve.run(app, name=name, route_prefix=f"/{name}")
    url = f"{ray_cluster}/{name}"
    try:
        deployment = "VaeDecoder" if ingress == "replica" else "VaeDecoder-kl"
        answers = asyncio.run(_load_through_a_kill(url, name, deployment))
        codes = [r.status_code for r in answers]
        assert 500 not in codes and set(codes) <= {200, 503}, codes
        assert 503 in codes  # the kill did catch requests in flight
        assert all(r.headers.get("retry-after") for r in answers if r.status_code == 503)
        assert _back_within(url, 30) < 30
    finally:
        serve.delete(name)
