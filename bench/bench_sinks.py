"""Sinks as bulkheads (serving/outputs/sinks.py, sink_writes.py): a healthy sink's write latency while
another sink's store hangs, measured side by side in one run, serving layer only (no Ray).

The hung sink is an S3 sink whose endpoint accepts connections, reads what it is sent and never
answers (a hung relay); the healthy one a local folder. Printed: the healthy sink's p50 and p95 per
request (two 64 KiB files) alone, then while requests to the hung sink keep coming (its writes
abandoned after write_timeout_s, then refused while its stuck calls fill its capacity), their
ratio; the hung sink's answers in that time (refused at once vs after the timeout); and how long
after its store answers (the relay closes: the stuck calls end) the hung sink writes again.
Usage: python bench/bench_sinks.py [--requests 60] [--write-timeout 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import Limits, Sink
from vae_service.engine import DecodeRequest, DecodeResult
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import Unavailable
from vae_service.engine.request.result import Timing
from vae_service.serving.outputs.sinks import Sinks

FILES = [os.urandom(64 * 1024), os.urandom(64 * 1024)]


class Silent:
    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                self.held.append(client)  # never read, never answered

    def close(self) -> None:
        for s in [self.listener, *self.held]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def request(sink: str, key: str) -> DecodeRequest:
    return DecodeRequest(torch.zeros(len(FILES), 4, 2, 2), output="png", sink=sink, key=key)


async def store(sinks: Sinks, sink: str, key: str) -> float:
    result = DecodeResult(list(FILES), "kl", "fp32", "lossless", None, Timing(0.0, 1.0, len(FILES)))
    started = time.perf_counter()
    await sinks.store(result, request(sink, key), RequestContext.admit(60.0, Limits()))
    return time.perf_counter() - started


async def healthy_latencies(sinks: Sinks, n: int, tag: str) -> list[float]:
    return [await store(sinks, "disk", f"{tag}/{i}") for i in range(n)]


async def keep_hitting(sinks: Sinks, stop: asyncio.Event, answers: dict) -> None:
    async def one(i: int) -> None:
        started = time.perf_counter()
        try:
            await store(sinks, "hung", f"h{i}")
        except Unavailable as exc:
            kind = "refused at once" if "busy" in exc.message else "503 after write_timeout_s"
            answers.setdefault(kind, []).append(time.perf_counter() - started)

    tasks, i = [], 0
    while not stop.is_set():
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3


async def main_async(args) -> None:
    silent = Silent()
    with tempfile.TemporaryDirectory() as folder:
        config = {
            "disk": Sink(uri=folder),
            "hung": Sink(
                uri="s3://bench/hung", endpoint_override=silent.endpoint, scheme="http", retry_attempts=1,
                connect_timeout_s=1.0, write_timeout_s=args.write_timeout,
            ),
        }  # fmt: skip
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        sinks = Sinks(config, retry_after_s=1.0)
        await healthy_latencies(sinks, 5, "warm")
        alone = await healthy_latencies(sinks, args.requests, "alone")
        stop, answers = asyncio.Event(), {}
        hitting = asyncio.ensure_future(keep_hitting(sinks, stop, answers))
        await asyncio.sleep(args.write_timeout * 1.5)  # its capacity taken, then stuck
        beside = await healthy_latencies(sinks, args.requests, "beside")
        state = sinks.describe()["hung"]
        stop.set()
        await hitting
        answered = time.perf_counter()
        silent.close()  # the store answers (with a reset): the stuck calls end
        while sinks.describe()["hung"]["stuck"]:
            await asyncio.sleep(0.01)
        recovered_s = time.perf_counter() - answered
    print("# the hung sink: an S3 endpoint that accepts and never answers; the healthy one: a local folder")
    rows = [
        ["alone", p(alone, 0.5), p(alone, 0.95), 1.0],
        ["while another sink's store hangs", p(beside, 0.5), p(beside, 0.95), p(beside, 0.5) / p(alone, 0.5)],
    ]
    print_table(
        f"A healthy sink's request (2 x 64 KiB files), {args.requests} requests each (ms)",
        ["healthy sink", "p50", "p95", "p50 vs alone"],
        rows,
    )
    print_table(
        f"The hung sink meanwhile (capacity {state['capacity']}, write_timeout_s {args.write_timeout:g})",
        ["answer", "requests", "p50 ms"],
        [[kind, len(times), p(times, 0.5)] for kind, times in sorted(answers.items())],
    )
    print(
        f"\nstuck calls when measured: {state['stuck']}; after its store answered, writing again in {recovered_s:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--write-timeout", type=float, default=1.0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
