"""Load generator against a local Serve (loopback only; bounded in count and time).

Prints, in one run: throughput and p50/p99 latency at concurrency 1, 8, 32 with mixed tiers
(alternating lossless/high), batching on (max_batch_size 8) vs max_batch_size=1 with Serve's
admission held equal (max_ongoing_requests, max_queued_requests: otherwise the derived
max_ongoing_requests of the unbatched mode would throttle it, not its lack of batching), for tiny-kl
(64 px outputs: per-request overhead dominates) and sd at 256 px; errors (target 0 under the
queue limit) and rejections (429/503) in an overload cell above it.
Usage: python bench/bench_load.py [--quick] [--cell-seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table

from vae_service_client.messages import MSGPACK, pack, request_map

LATENT = {"tiny-kl": 8, "sd": 32}


async def run_cell(url: str, channels: int, side: int, concurrency: int, count: int, seconds: float) -> dict:
    bodies = [pack(request_map(torch.randn(1, channels, side, side), quality=q)) for q in ("lossless", "high")]
    latencies, statuses = [], []
    sem = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + seconds

    async def one(i: int, http: httpx.AsyncClient) -> None:
        async with sem:
            if time.perf_counter() > deadline:
                return
            t = time.perf_counter()
            try:
                r = await http.post(
                    f"{url}/decode",
                    content=bodies[i % 2],
                    headers={"content-type": MSGPACK},
                    timeout=max(1.0, deadline - t + 30),
                )
                statuses.append(r.status_code)
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t)
            except httpx.TimeoutException:
                statuses.append(-1)

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)) as http:
        await asyncio.gather(*(one(i, http) for i in range(count)))
    elapsed = time.perf_counter() - start
    lat = sorted(latencies)
    return {
        "ok": len(lat),
        "rps": len(lat) / elapsed,
        "p50": statistics.median(lat) * 1e3 if lat else float("nan"),
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else float("nan"),
        "rejected": sum(s in (429, 503) for s in statuses),
        "errors": sum(s not in (200, 429, 503, -1) for s in statuses),
        "cut": sum(s == -1 for s in statuses),  # still waiting when the cell's time ran out
    }


HELD_EQUAL = {"max_ongoing_requests": 32, "max_queued_requests": 64}  # Serve's admission, both modes
MODES = {"batched": 8, "max_batch_size=1": 1}


def run_mode(base: str, model: str, mode: str, cell_seconds: float) -> dict[int, dict]:
    from ray import serve

    from vae_service.serving.app import decoder_app

    name = f"{model}-{MODES[mode]}"
    config = {"model": model, "batching": {"max_batch_size": MODES[mode]}}
    serve.run(decoder_app(config, **HELD_EQUAL), name=name, route_prefix=f"/{name}")
    asyncio.run(run_cell(f"{base}/{name}", 4, LATENT[model], 2, 4, cell_seconds))  # warm-up
    cells = {}
    for conc in (1, 8, 32):
        count = 40 * conc if model == "tiny-kl" else 2 * conc
        cells[conc] = asyncio.run(run_cell(f"{base}/{name}", 4, LATENT[model], conc, count, cell_seconds))
        print(f"  {model} {mode} c={conc}: {cells[conc]}", flush=True)
    serve.delete(name)
    return cells


def row(model: str, mode: str, conc: int | str, cell: dict) -> list:
    keys = ("ok", "rps", "p50", "p99", "errors", "rejected", "cut")
    return [model, mode, conc, *(cell[k] for k in keys)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny-kl only")
    parser.add_argument("--cell-seconds", type=float, default=60.0)
    args = parser.parse_args()
    from ray import serve

    from vae_service.serving.app import decoder_app

    models = ["tiny-kl"] if args.quick else ["tiny-kl", "sd"]
    rows = []
    with local_serve() as base:
        for model in models:
            results = {mode: run_mode(base, model, mode, args.cell_seconds) for mode in MODES}
            for mode, cells in results.items():
                rows += [row(model, mode, conc, cell) for conc, cell in cells.items()]
            for conc in (1, 8, 32):
                b, u = results["batched"][conc]["rps"], results["max_batch_size=1"][conc]["rps"]
                rows.append([model, "batched / unbatched", conc, "", b / u if u else float("nan"), "", "", "", "", ""])
        # above the queue limit: rejections, never errors
        overload = {
            "model": "tiny-kl",
            "serving": {"max_queued_requests": 16, "concurrent_keys": 1},
            "batching": {"max_batch_size": 4},
        }
        serve.run(decoder_app(overload), name="overload", route_prefix="/overload")
        cell = asyncio.run(run_cell(f"{base}/overload", 4, 32, 200, 400, args.cell_seconds))
        rows.append(row("tiny-kl 256px", "overload (queue 16)", 200, cell))
    held = ", ".join(f"{k}={v}" for k, v in HELD_EQUAL.items())
    print_table(
        f"HTTP load, mixed tiers (loopback); held equal across modes: {held}, 1 replica, same model, "
        "threads and batch_wait_ms; only max_batch_size differs",
        ["model", "mode", "concurrency", "ok", "req/s", "p50 ms", "p99 ms", "errors", "rejected", "cut off"],
        rows,
    )


if __name__ == "__main__":
    main()
