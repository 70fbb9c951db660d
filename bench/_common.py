"""Helpers shared by the benchmarks: medians, a local Serve instance, a table printer."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable


def median_s(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextlib.contextmanager
def local_serve(grpc_port: int | None = None):
    """A local Ray + Serve on a free loopback port (and Serve's gRPC proxy on `grpc_port`, serving
    vae_service.v1.VaeDecoder); yields the base URL; stops what it started."""
    import ray
    from ray import serve

    from vae_service.serving.wire.proxy_guard import proxy_guard_env

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.update(proxy_guard_env())  # as the CLI runs the service
    port = free_port()
    # a cluster of its own, never one a `ray start` on this machine left running
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    grpc_options = None
    if grpc_port is not None:
        from ray.serve.config import gRPCOptions

        from vae_service.serving.app import GRPC_SERVICER

        grpc_options = gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER])
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n## {title}")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
