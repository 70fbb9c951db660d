"""Soak: mixed-tier, mixed-output load against a local service for a set duration (loopback only;
bounded by --seconds and --concurrency). Prints requests, answers by status, p50/p99, and the
replica's resident memory at the start (after warm-up) and at the end, with its folded bytes:
memory should stay flat.
Usage: python bench/soak.py [--seconds 600] [--concurrency 16] [--model tiny-kl]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table

from vae_service_client.messages import MSGPACK, pack, request_map

MIX = [("lossless", "uint8"), ("high", "uint8"), ("lossless", "png"), ("high", "float"), ("high", "jpeg")]


async def load(url: str, seconds: float, concurrency: int, channels: int) -> tuple[collections.Counter, list]:
    rng = np.random.default_rng(0)
    sizes = [(1, 8, 8), (2, 8, 8), (1, 16, 12), (1, 5, 7)]  # a few shapes: a few batch keys
    bodies = [
        pack(request_map(rng.standard_normal((b, channels, h, w)).astype(np.float32), quality, output))
        for b, h, w in sizes
        for quality, output in MIX
    ]
    statuses, latencies = collections.Counter(), []
    end = time.perf_counter() + seconds

    async def worker(i: int, http: httpx.AsyncClient) -> None:
        n = i
        while time.perf_counter() < end:
            start = time.perf_counter()
            try:
                r = await http.post(f"{url}/decode", content=bodies[n % len(bodies)], headers={"content-type": MSGPACK})
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - start)
            except httpx.TransportError as exc:
                statuses[type(exc).__name__] += 1
            n += concurrency

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        await asyncio.gather(*(worker(i, http) for i in range(concurrency)))
    return statuses, latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", default="tiny-kl")
    parser.add_argument("--warmup-seconds", type=float, default=30)
    args = parser.parse_args()
    from ray import serve

    from vae_service.serving.app import decoder_app

    with local_serve() as base, httpx.Client(timeout=60) as http:
        serve.run(decoder_app({"model": args.model}), name="soak", route_prefix="/soak")
        url = f"{base}/soak"
        channels = http.get(f"{url}/health").json()["latent_channels"]
        asyncio.run(load(url, args.warmup_seconds, args.concurrency, channels))
        before = http.get(f"{url}/health").json()
        statuses, latencies = asyncio.run(load(url, args.seconds, args.concurrency, channels))
        after = http.get(f"{url}/health").json()
    lat = sorted(latencies)
    mib = 2**20
    rows = [
        [
            sum(statuses.values()),
            statuses.get(200, 0),
            ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str) if k != 200) or "none",
            statistics.median(lat) * 1e3 if lat else float("nan"),
            lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else float("nan"),
            before["rss_bytes"] / mib,
            after["rss_bytes"] / mib,
            after["fast_path"]["folded_bytes"] / mib,
        ]
    ]
    print_table(
        f"Soak: {args.model}, {args.seconds:.0f} s at concurrency {args.concurrency}, mixed tiers and outputs "
        f"(after {args.warmup_seconds:.0f} s warm-up)",
        ["requests", "ok", "other answers", "p50 ms", "p99 ms", "replica RSS start MiB", "RSS end MiB", "folded MiB"],
        rows,
    )


if __name__ == "__main__":
    main()
