"""A /decode's latency alone vs beside idle decode-session connections, on one running service (one
replica of tiny-kl): WebSockets that connect to /sessions and send nothing, more of them than the
replica has decode slots (`batching.max_batch_size x serving.concurrent_keys`). Before session
connections had a room of their own within the slots (`sessions.max_connections`, never more than
the slots less a full batch), such sockets held every slot and a /decode waited until they closed
(a review measured a 0.09 s decode answered after 32.1 s). Printed: the /decode round trip p50/p99
with 0 idle connections and with N, their ratio, and how many of the N the replica held (the rest
refused at once, 429 naming `session`).

Seeded random weights: they decode noise; the timings do not depend on them.
Usage: python bench/bench_idle_connections.py [--quick] [--rounds N] [--idle N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table

SLOTS, CONNECTIONS = (2, 4), 6  # max_batch_size x concurrent_keys = 8 decode slots, 6 of them for connections


def decode_times(client, z: np.ndarray, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        client.decode(z)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--idle", type=int, default=20, help="idle connections (over the 8 decode slots)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    from ray import serve
    from websockets.sync.client import connect

    from vae_service.serving.app import decoder_app
    from vae_service_client import VaeClient

    config = {
        "model": "tiny-kl",
        "batching": {"max_batch_size": SLOTS[0]},
        "serving": {"concurrent_keys": SLOTS[1]},
        "sessions": {"max_connections": CONNECTIONS, "open_timeout_s": 600},
    }
    z = np.random.default_rng(0).standard_normal((1, 4, 16, 16), dtype=np.float32)
    with local_serve() as url:
        serve.run(decoder_app(config), name="vae", route_prefix="/vae")
        client = VaeClient(f"{url}/vae", timeout=120)
        decode_times(client, z, 3)  # warm
        alone = decode_times(client, z, args.rounds)
        with contextlib.ExitStack() as sockets:
            for _ in range(args.idle):
                sockets.enter_context(connect(f"{url.replace('http', 'ws', 1)}/vae/sessions", open_timeout=60))
            beside = decode_times(client, z, args.rounds)
            held = client.health()["sessions"]["connections"]
    rows = [
        [0, statistics.median(alone), p99(alone), "1 (baseline)", "-"],
        [args.idle, statistics.median(beside), p99(beside), statistics.median(beside) / statistics.median(alone), held],
    ]
    print("# tiny-kl: seeded random weights, it decodes noise")
    print_table(
        f"/decode beside idle session connections, {SLOTS[0] * SLOTS[1]} decode slots, {args.rounds} rounds (ms)",
        ["idle connections", "p50", "p99", "p50 vs alone", "held by the replica"],
        rows,
    )


if __name__ == "__main__":
    main()
