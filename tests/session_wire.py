"""The decode sessions' wire as the integration tests speak it: a raw WebSocket client (the
`websockets` library sending the documented msgpack messages), the tiny Wan decoder's latents, and
the replicas' own account of their sessions (/health)."""

from __future__ import annotations

import time

import httpx
import msgpack
import numpy as np
import ray

from vae_service_client import VaeClient
from vae_service_client.messages import latents_map, pack
from vae_service_client.tensors import decode_tensor

H, W, C = 6, 10, 4


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://", 1) + "/sessions"


def send(ws, kind: str, fields: dict) -> None:
    ws.send(pack({kind: fields}))


def receive(ws, timeout: float = 60) -> dict:
    return msgpack.unpackb(ws.recv(timeout=timeout), raw=False)


def chunk_answer(ws, z: np.ndarray, latent_frame: int) -> tuple[list[dict], dict]:
    """Send one chunk; its frame messages and its chunk_done (or the error message)."""
    send(ws, "chunk", {"latents": latents_map(z), "latent_frame": latent_frame})
    messages = []
    while True:
        message = receive(ws)
        if "chunk_done" in message or "error" in message:
            return messages, message
        messages.append(message)


def pixels_of(messages: list[dict]) -> np.ndarray:
    return np.concatenate([decode_tensor(m["pixels"], "pixels").to_numpy() for m in messages], axis=1)


def whole_answer(url: str, z: np.ndarray, **options):
    return VaeClient(url).decode(z, **options).output


def latents(t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, C, t, H, W)).astype(np.float32)


def kill_owner(session_id: str, app: str = "sessions") -> None:
    """Kills the replica of application `app` holding a session (its id begins with the replica's):
    Serve starts another."""
    owner = session_id.split(".", 1)[0]
    killed = 0
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#") and actor["name"].endswith(owner):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            killed += 1
    assert killed == 1, session_id


def replica_health(url: str, replicas: int, timeout_s: float = 60) -> dict[str, dict]:
    """Each replica's /health (an answer is one replica's; Serve picks which): asked until all
    `replicas` answered, through restarts (a killed replica's successor starting)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        assert time.monotonic() < deadline, f"only {sorted(seen)} of {replicas} replicas answered /health"
        try:
            answer = httpx.get(f"{url}/health", timeout=30)
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if answer.status_code == 200:
            health = answer.json()
            seen[health["replica"]] = health
        else:
            time.sleep(0.1)
    return seen


def sessions_open(url: str, replicas: int = 2) -> int:
    """Open sessions over all the application's replicas."""
    return sum(h["sessions"]["open"] for h in replica_health(url, replicas).values())


def wait_until(condition, timeout_s: float, what: str, every_s: float = 0.05) -> float:
    """Seconds until `condition()` held; fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(every_s)
    return time.monotonic() - start
