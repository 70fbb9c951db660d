"""The clients' transport failures are typed errors whose text is one line naming the URL (or gRPC
target) and the cause: nothing listening, nothing received within the timeout, the connection
closed before the answer was complete. A cut unary answer is retried like a 503; a stream cut after
frames went out is not (the caller has them). The servers here are real sockets in a thread,
answering each connection from a script."""

import io
import socket
import struct
import threading
import types

import numpy as np
import pytest

from tests.ports import free_port
from vae_service_client import (
    AsyncVaeClient,
    AsyncVaeGrpcClient,
    DecodeTimeout,
    ServiceUnreachable,
    Unavailable,
    VaeClient,
    VaeGrpcClient,
    VaeServiceError,
    retries,
)
from vae_service_client.frames import STREAM_MEDIA_TYPE, framed, frames_message
from vae_service_client.messages import MSGPACK, DecodeResponse, pack

Z = np.zeros((1, 4, 8, 8), np.float32)
PIXELS = np.arange(1 * 8 * 8 * 3, dtype=np.uint8).reshape(1, 8, 8, 3)
TIMING = {"queue_ms": 1.0, "decode_ms": 2.0, "encode_ms": 0.0, "batch_size": 1, "replicas": 1}
ANSWER = pack(DecodeResponse(PIXELS, "kl", "lossless", "fp32", "r1", TIMING).to_map())


class Server:
    """Answers its n-th connection with `scripts[n]` (the last one again after them) once it read
    the request; counts connections."""

    def __init__(self, *scripts):
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)  # closing a socket does not wake a thread in accept(): look at `stop`
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections, self._scripts, self.stop = 0, scripts, threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                _read_request(conn)
                self._scripts[min(self.connections, len(self._scripts)) - 1](self, conn)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(2)
        self._sock.close()


@pytest.fixture
def serve():
    servers = []

    def start(*scripts) -> Server:
        servers.append(Server(*scripts))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        if not (more := conn.recv(65536)):
            return
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        (int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), 0
    )
    while len(body) < length:
        body += conn.recv(65536)


def _head(media_type: str, length: int | None = None) -> bytes:
    size = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return f"HTTP/1.1 200 OK\r\ncontent-type: {media_type}\r\n{size}\r\n\r\n".encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def answers(server: Server, conn: socket.socket) -> None:
    conn.sendall(_head(MSGPACK, len(ANSWER)) + ANSWER)


def hangs(server: Server, conn: socket.socket) -> None:
    server.stop.wait(5)


def cut_mid_answer(server: Server, conn: socket.socket) -> None:
    conn.sendall(_head(MSGPACK, len(ANSWER)) + ANSWER[:100])  # closed after a part of the body


def reset_mid_answer(server: Server, conn: socket.socket) -> None:
    conn.sendall(_head(MSGPACK, len(ANSWER)) + ANSWER[:100])
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends a reset


def two_frames_then_cut(server: Server, conn: socket.socket) -> None:
    frames = [framed(frames_message(0, f, np.zeros((1, 1, 2, 2, 3), np.uint8))) for f in range(2)]
    conn.sendall(_head(STREAM_MEDIA_TYPE) + b"".join(_chunk(f) for f in frames))  # no last chunk, no `done`


def one_box_then_cut(server: Server, conn: socket.socket) -> None:
    conn.sendall(_head("video/mp4") + _chunk(struct.pack(">I4s", 16, b"ftyp") + b"isom\0\0\0\0"))


def one_line(exc: VaeServiceError) -> str:
    text = str(exc)
    assert "\n" not in text and exc.status is None and exc.field is None
    return text


@pytest.fixture
def retry_waits(monkeypatch) -> list[float]:
    """The waits of the clients' retry policy (retries.py) before each retry, recorded instead of
    slept: a retry adds one (backoff_s or more) and costs the test no time."""
    waits: list[float] = []
    monkeypatch.setattr(retries, "time", types.SimpleNamespace(sleep=waits.append))
    return waits


def test_nothing_listening_is_unreachable_at_once_naming_the_url(retry_waits):
    url = f"http://127.0.0.1:{free_port()}"
    with VaeClient(url, retries=3, backoff_s=5) as client:  # a retry would wait 5 s
        with pytest.raises(ServiceUnreachable) as err:
            client.decode(Z)
        assert one_line(err.value) == f"HTTP unreachable: POST {url}/decode: connection refused (nothing listening)"
        assert (err.value.type, err.value.via) == ("unreachable", "http")
        with pytest.raises(ServiceUnreachable, match=f"^HTTP unreachable: GET {url}/health: connection refused"):
            client.health()
        with pytest.raises(ServiceUnreachable, match=f"^HTTP unreachable: POST {url}/decode: connection refused"):
            list(client.decode_frames(Z))
    assert retry_waits == []  # never retried: each call's one attempt raised at once


async def test_nothing_listening_is_unreachable_for_the_async_client_too():
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncVaeClient(url, retries=3, backoff_s=5) as client:
        with pytest.raises(ServiceUnreachable) as err:
            await client.decode(Z)
        assert one_line(err.value) == f"HTTP unreachable: POST {url}/decode: connection refused (nothing listening)"
        with pytest.raises(ServiceUnreachable, match=f"^HTTP unreachable: POST {url}/decode: connection refused"):
            await client.decode_mp4(Z, io.BytesIO())


def test_no_answer_within_the_timeout_is_a_decode_timeout_not_retried(serve):
    server = serve(hangs)
    with VaeClient(server.url, timeout=0.3, retries=3, backoff_s=0.01) as client, pytest.raises(DecodeTimeout) as err:
        client.decode(Z)
    assert one_line(err.value) == f"HTTP timeout: POST {server.url}/decode: nothing received within timeout=0.3 s"
    assert server.connections == 1  # it would take as long again


@pytest.mark.parametrize("cut", [cut_mid_answer, reset_mid_answer])
def test_an_answer_cut_off_is_unavailable_once_the_retries_are_spent(serve, cut):
    server = serve(cut)
    with VaeClient(server.url, retries=1, backoff_s=0.01) as client, pytest.raises(Unavailable) as err:
        client.decode(Z)
    prefix = f"HTTP unavailable: POST {server.url}/decode: the connection closed before the answer was complete ("
    assert one_line(err.value).startswith(prefix) and err.value.type == "unavailable"
    assert server.connections == 2


def test_an_answer_cut_off_is_retried_like_a_503(serve):
    server = serve(cut_mid_answer, answers)
    with VaeClient(server.url, retries=1, backoff_s=0.01) as client:
        resp = client.decode(Z)
    assert np.array_equal(resp.output, PIXELS) and server.connections == 2


async def test_the_async_client_retries_an_answer_cut_off(serve):
    server = serve(reset_mid_answer, answers)
    async with AsyncVaeClient(server.url, retries=1, backoff_s=0.01) as client:
        resp = await client.decode(Z)
    assert np.array_equal(resp.output, PIXELS) and server.connections == 2


def test_a_frame_stream_cut_after_its_frames_is_unavailable_not_retried(serve):
    server = serve(two_frames_then_cut, answers)
    chunks = []
    with VaeClient(server.url, retries=3, backoff_s=0.01) as client, pytest.raises(Unavailable) as err:
        for chunk in client.decode_frames(Z):
            chunks.append(chunk.frame)
    assert chunks == [0, 1] and server.connections == 1  # the caller had the frames: not sent again
    assert one_line(err.value).startswith(f"HTTP unavailable: POST {server.url}/decode: the connection closed before")


async def test_an_async_frame_stream_and_mp4_stream_cut_off_are_unavailable(serve):
    server = serve(two_frames_then_cut, one_box_then_cut)
    async with AsyncVaeClient(server.url, retries=3, backoff_s=0.01) as client:
        chunks = []
        with pytest.raises(Unavailable, match=f"^HTTP unavailable: POST {server.url}/decode: the connection closed"):
            async for chunk in client.decode_frames(Z):
                chunks.append(chunk.frame)
        assert chunks == [0, 1]
        target = io.BytesIO()
        with pytest.raises(Unavailable, match=f"^HTTP unavailable: POST {server.url}/decode: the connection closed"):
            await client.decode_mp4(Z, target)
    assert len(target.getvalue()) == 16 and server.connections == 2  # the box that came is written


def test_an_mp4_stream_cut_off_is_unavailable(serve):
    server = serve(one_box_then_cut)
    with VaeClient(server.url, retries=3, backoff_s=0.01) as client, pytest.raises(Unavailable) as err:
        client.decode_mp4(Z, io.BytesIO())
    assert one_line(err.value).startswith(f"HTTP unavailable: POST {server.url}/decode: the connection closed before")


def test_grpc_nothing_listening_is_unreachable_at_once_naming_the_target(retry_waits):
    target = f"127.0.0.1:{free_port()}"
    with VaeGrpcClient(target, retries=3, backoff_s=5) as client:  # a retry would wait 5 s
        with pytest.raises(ServiceUnreachable) as err:
            client.decode(Z)
        assert one_line(err.value) == f"gRPC UNAVAILABLE unreachable: {target}: connection refused (nothing listening)"
        assert (err.value.via, err.value.grpc_code) == ("grpc", "UNAVAILABLE")
        with pytest.raises(ServiceUnreachable, match=f"^gRPC UNAVAILABLE unreachable: {target}: connection refused"):
            list(client.decode_frames(Z))
    assert retry_waits == []  # never retried: each call's one attempt raised at once


async def test_async_grpc_nothing_listening_is_unreachable():
    target = f"127.0.0.1:{free_port()}"
    async with AsyncVaeGrpcClient(target, retries=3, backoff_s=5) as client:
        with pytest.raises(ServiceUnreachable, match=f"^gRPC UNAVAILABLE unreachable: {target}: connection refused"):
            await client.decode(Z)


def test_grpc_no_answer_within_the_timeout_names_the_target_and_the_timeout(serve):
    server = serve(hangs)  # reads the HTTP/2 preface, then says nothing
    target = server.url.removeprefix("http://")
    with VaeGrpcClient(target, timeout=0.3, retries=3, backoff_s=0.01) as client, pytest.raises(DecodeTimeout) as err:
        client.decode(Z)
    text = str(err.value)
    assert text.startswith(f"gRPC DEADLINE_EXCEEDED deadline_exceeded: {target}: ") and text.endswith("(timeout=0.3 s)")
    assert "\n" not in text and server.connections == 1  # not retried
