"""The decode sessions' wire as the integration tests speak it: a raw WebSocket client (the
`websockets` library sending the documented msgpack messages), the tiny Wan decoder's latents, and
the replicas' own account of their sessions (/health)."""

from __future__ import annotations

import time

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
    """Each replica's /health fields (DecoderReplica.describe), asked of every running replica of
    the application served at `url` (route prefix `/<app>-app`) through a handle pinned to it (the
    session router sends a call whose session id begins with a replica's id there): through HTTP,
    Serve's power-of-two choices keeps sending /health to the less busy replica, and a replica that
    holds a long connection may never be asked. Asked until `replicas` answered (through restarts)."""
    from ray import serve

    app = url.rstrip("/").rsplit("/", 1)[1].removesuffix("-app")
    handle = serve.get_app_handle(app)
    deadline = time.monotonic() + timeout_s
    while True:
        seen: dict[str, dict] = {}
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if not actor["name"].startswith(f"SERVE_REPLICA::{app}#"):
                continue
            replica = actor["name"].rsplit("#", 1)[1]
            try:
                health = handle.options(session_id=f"{replica}.health").describe.remote().result(timeout_s=10)
            except Exception:  # a replica starting or just killed: asked again below
                continue
            if health["replica"] == replica:  # not one that answered in place of a replica gone
                seen[replica] = health
        if len(seen) >= replicas:
            return seen
        assert time.monotonic() < deadline, f"only {sorted(seen)} of {replicas} replicas answered"
        time.sleep(0.1)


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


def decoded_video(data: bytes) -> list[tuple[float, np.ndarray]]:
    """A file's frames as a player shows them: (time in seconds, RGB)."""
    import io

    import av

    with av.open(io.BytesIO(data)) as container:
        return [(round(float(f.time), 6), f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
