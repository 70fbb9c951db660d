"""Documented promises that no other test held (each could be broken with the suite green): read
from the docs where they give a number, checked on the surface the docs describe, so breaking the
promise turns a test here red.

- bodies are parsed with at most N levels of nesting (docs/interfaces.md);
- a retry waits at least the server's Retry-After, the client's own backoff is capped at 8 s, and a
  Retry-After above the cap is honoured (clients/vae_service_client/retries.py, README);
- a connect timeout is `unreachable`: never retried, never a decode timeout;
- a video's encode price counts its frames (docs/configuration.md: "the pixels of all items and frames").

A key segment's byte bound is held in tests/unit/test_sinks.py."""

import contextlib
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from tests.unit.test_client_transport import Server, serve  # noqa: F401 (the fixture)
from vae_service.engine.request.errors import InvalidInput, LimitExceeded
from vae_service.protocol.msgpack_body import unpack_body
from vae_service_client import DecodeTimeout, Overloaded, ServiceUnreachable, VaeClient
from vae_service_client.errors import error_json

DOCS = Path(__file__).resolve().parents[2] / "docs"


def documented_depth() -> int:
    text = " ".join((DOCS / "interfaces.md").read_text().split())
    return int(re.search(r"(\d+) levels of nesting", text).group(1))


def nested(depth: int) -> bytes:
    """A /decode-like body whose deepest value sits inside `depth` containers (the body counts)."""
    value: object = 1
    for _ in range(depth - 1):
        value = [value]
    return msgpack.packb({"quality": "lossless", "extra": value})


def test_bodies_nest_at_most_as_deep_as_the_docs_say():
    depth = documented_depth()
    assert unpack_body(nested(depth), 2**20)["extra"] is not None  # the documented depth reads
    with pytest.raises(InvalidInput) as refused:
        unpack_body(nested(depth + 1), 2**20)
    assert refused.value.field == "body" and "nest" in str(refused.value)


def overloaded_for(retry_after: int):
    body = error_json("overloaded", None, "busy")

    def answer(server: Server, conn: socket.socket) -> None:
        head = (
            f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {retry_after}\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        conn.sendall(head.encode() + body)

    return answer


@pytest.mark.parametrize(
    "retry_after, backoff_s, waits",
    [
        (1, 4.0, [4.0, 8.0, 8.0]),  # its own backoff doubles from 4 s and stops at the 8 s cap
        (20, 0.5, [20.0, 20.0, 20.0]),  # a Retry-After above the cap is honoured, never cut to it
        (3, 0.5, [3.0, 3.0, 3.0]),  # never sooner than Retry-After
    ],
)
def test_a_retry_waits_the_servers_retry_after_and_the_clients_backoff_is_capped(
    serve,  # noqa: F811
    monkeypatch,
    retry_after,
    backoff_s,
    waits,
):
    server = serve(overloaded_for(retry_after))
    slept = []
    monkeypatch.setattr("vae_service_client.retries.time.sleep", slept.append)
    with VaeClient(server.url, retries=3, backoff_s=backoff_s) as client, pytest.raises(Overloaded):
        client.decode(np.zeros((1, 4, 8, 8), np.float32))
    assert slept == waits and server.connections == 4


_WATCHED: dict[int, list] = {}  # port -> the addresses connected to meanwhile
_HOOKED: list[bool] = []  # an audit hook stays for good: added once


def _audit(event: str, args: tuple) -> None:
    if event == "socket.connect" and _WATCHED:
        address = args[1]
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in _WATCHED:
            _WATCHED[address[1]].append(address)


@contextlib.contextmanager
def connects_to(port: int) -> Iterator[list]:
    """Every connection attempt this process makes to `port` meanwhile (Python's `socket.connect`
    audit event: one per attempt, whoever makes it, the client's retries or its transport's)."""
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    _WATCHED[port] = attempts = []
    try:
        yield attempts
    finally:
        del _WATCHED[port]


def test_a_connect_timeout_is_unreachable_never_retried_nor_a_decode_timeout(monkeypatch):
    """A listener whose queue is full (backlog 0, one connection waiting) never completes another
    handshake: the client's connect times out."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    queued = socket.create_connection(("127.0.0.1", port))
    slept = []
    monkeypatch.setattr("vae_service_client.retries.time.sleep", slept.append)
    try:
        client = VaeClient(f"http://127.0.0.1:{port}", timeout=0.5, retries=3)
        with client, connects_to(port) as attempts, pytest.raises(ServiceUnreachable) as err:
            client.decode(np.zeros((1, 4, 8, 8), np.float32))
    finally:
        queued.close()
        listener.close()
    assert not isinstance(err.value, DecodeTimeout) and err.value.type == "unreachable"
    assert "timed out connecting" in str(err.value)
    assert len(attempts) == 1 and slept == []  # one attempt, not four timeouts and their backoff


def test_a_videos_encode_price_counts_its_frames(wan_dir):
    """With max_encode_seconds between one frame's price and 81 frames' (21 latent frames), the
    81-frame mp4 and webm are refused naming `output` and the one-frame ones are not."""
    from vae_service.config import Limits, ServiceConfig
    from vae_service.engine import DecodeEngine, DecodeRequest

    assert "pixels of all items and frames" in (DOCS / "configuration.md").read_text()
    probe = DecodeEngine(ServiceConfig(model=str(wan_dir)))
    h = w = 8
    pixels_per_frame = h * w * probe.spec.spatial_scale**2
    for output in ("mp4", "webm"):
        one, all_81 = (probe.encode_price.seconds(output, n * pixels_per_frame) for n in (1, 81))
        limit = (one * all_81) ** 0.5  # between the two, far from both
        engine = DecodeEngine(ServiceConfig(model=str(wan_dir), limits=Limits(max_encode_seconds=limit)))
        z = torch.zeros(1, probe.spec.latent_channels, 21, h, w)
        engine.prepare(DecodeRequest(z[:, :, :1], output=output))
        with pytest.raises(LimitExceeded) as refused:
            engine.prepare(DecodeRequest(z, output=output))
        assert refused.value.field == "output" and "max_encode_seconds" in str(refused.value)
