"""A real S3-compatible store for the tests: moto's standalone server (`moto[server]`, the `test`
extra) on a free localhost port, one per session, started and stopped by the suite (its own
process, by pid). Clients are pyarrow's S3FileSystem with `endpoint_override`, as in service.

Its dummy credentials (S3_ENV) are set in this process while it runs and reach Ray's workers
through tests/integration/conftest.py's runtime_env; AWS_EC2_METADATA_DISABLED keeps the AWS SDK
from probing an instance metadata service that is not there."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from tests.ports import free_port

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
BUCKET = "vae-test"
START_S = 60.0  # moto imports most of boto on start: seconds on a busy CI machine


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # host:port
    pid: int

    def filesystem(self):
        """A client of our own: what the tests read the store with (never the code under test's)."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region="us-east-1")

    def uri(self, prefix: str) -> str:
        """s3://BUCKET/prefix with the endpoint in its query (how batch-decode names a test store)."""
        return f"s3://{BUCKET}/{prefix}?endpoint_override={self.endpoint}&scheme=http"

    def read(self, path: str) -> bytes | None:
        """An object's bytes (`path` below the bucket), None when there is none."""
        import pyarrow.fs as pafs

        fs = self.filesystem()
        if fs.get_file_info(f"{BUCKET}/{path}").type != pafs.FileType.File:
            return None
        with fs.open_input_stream(f"{BUCKET}/{path}") as f:
            return f.read()

    def listing(self, prefix: str) -> list[str]:
        """Every object below a prefix (hidden temporaries too), by path below the bucket."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True)
        infos = self.filesystem().get_file_info(selector)
        return sorted(i.path.removeprefix(f"{BUCKET}/") for i in infos if i.type == pafs.FileType.File)


def _wait_for_port(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto's server exited at start (status {process.returncode})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"moto's server did not listen on port {port} within {START_S:g} s")


@pytest.fixture(scope="session")
def s3_server():
    """moto's server with bucket BUCKET, S3_ENV set in this process; stopped (by pid) at the end."""
    import pyarrow.fs as pafs

    patch = pytest.MonkeyPatch()
    for key, value in S3_ENV.items():
        patch.setenv(key, value)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, process)
        server = S3Server(f"127.0.0.1:{port}", process.pid)
        pafs.S3FileSystem(
            endpoint_override=server.endpoint, scheme="http", region="us-east-1", allow_bucket_creation=True
        ).create_dir(BUCKET)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        patch.undo()


class _Listener:
    """A localhost port whose connections a subclass serves (`_serve`), every socket closed on demand."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            self._serve(client)

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    def _keep(self, *sockets: socket.socket) -> None:
        with self.lock:
            self.sockets += sockets

    def close(self) -> None:
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class Gate(_Listener):
    """A TCP relay to the store on a port of its own, closed on demand: the store as its clients
    see it when it stops mid-request (open connections cut, new ones refused). `close_on`: a
    pattern of the requests' bytes (e.g. rb"PUT /bucket/key "): the gate closes as that request
    arrives, before forwarding it: a stop at a chosen point of a job."""

    def __init__(self, target: str, close_on: bytes | None = None):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.close_on = re.compile(close_on) if close_on else None
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        self._keep(client, upstream)
        threading.Thread(target=self._pump, args=(client, upstream, self.close_on), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, close_on: re.Pattern | None) -> None:
        try:
            while data := source.recv(65536):
                if close_on is not None and close_on.search(data):
                    self.close()
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


class Silent(_Listener):
    """A store that accepts connections, reads what it is sent and never answers (a hung relay or
    load balancer): its clients' calls block until it closes."""

    def _serve(self, client: socket.socket) -> None:
        self._keep(client)
        threading.Thread(target=self._drain, args=(client,), daemon=True).start()

    @staticmethod
    def _drain(client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while client.recv(65536):
                pass
