"""A decode session's chunk over each transport, on one running service, measured side by side and
interleaved (each round sends the same chunk through every session in turn, rotating the order):
the WebSocket (`/sessions`, VaeClient.session) and gRPC (`DecodeSession`, VaeGrpcClient.session:
Serve 2.60's gRPC proxy relays each client message to the replica by an actor call). Printed per
chunk size: the client's round trip p50, the replica's own part (`timing`: queue + decode +
encode), and what each transport adds (round trip - the replica's part); gRPC's added over the
WebSocket's as a ratio. Every session's frames are checked equal to the WebSocket's.

Uses tiny-wan (a chunk decodes in milliseconds, so the transport's share shows). Seeded random
weights: they decode noise; the timings do not depend on them.
Usage: python bench/bench_session_transports.py [--quick] [--rounds N] [--height 16 --width 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import free_port, local_serve, print_table

CHUNKS = (1, 3)  # latent frames per chunk: one at a time, and what Self-Forcing/CausVid send


def timed(session, z: np.ndarray) -> tuple[float, float, np.ndarray]:
    sent = time.perf_counter()
    part = session.decode(z)
    trip = time.perf_counter() - sent
    t = part.timing
    return trip, (t["queue_ms"] + t["decode_ms"] + t["encode_ms"]) / 1e3, part.pixels


def measure(clients: dict, args, latent_frames: int) -> list:
    rng = np.random.default_rng(latent_frames)
    shape = (1, 4, latent_frames, args.height, args.width)
    sessions = {name: client.session(args.height, args.width) for name, client in clients.items()}
    trips: dict = {name: [] for name in sessions}
    server: dict = {name: [] for name in sessions}
    names = list(sessions)
    try:
        for k in range(args.rounds + 1):  # round 0 warms each session's first-chunk path
            z = rng.standard_normal(shape, dtype=np.float32)
            frames = {}
            for name in names[k % len(names) :] + names[: k % len(names)]:
                trip, part, frames[name] = timed(sessions[name], z)
                if k:
                    trips[name].append(trip)
                    server[name].append(part)
            for name in names[1:]:
                np.testing.assert_array_equal(frames[name], frames[names[0]])
    finally:
        for session in sessions.values():
            session.close()
    rows = []
    for name in names:
        trip, part = statistics.median(trips[name]) * 1e3, statistics.median(server[name]) * 1e3
        rows.append([latent_frames, name, trip, part, trip - part])
    rows[-1].append(rows[-1][4] / rows[0][4])
    rows[0].append("1 (baseline)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--width", type=int, default=16)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    from ray import serve

    from vae_service.serving.app import decoder_app
    from vae_service_client import VaeClient, VaeGrpcClient

    grpc_port = free_port()
    with local_serve(grpc_port) as url:
        serve.run(decoder_app({"model": "tiny-wan", "model_name": "wan"}), name="vae", route_prefix="/vae")
        clients = {
            "WebSocket": VaeClient(f"{url}/vae"),
            "gRPC DecodeSession": VaeGrpcClient(f"127.0.0.1:{grpc_port}", application="vae"),
        }
        rows = [row for latent_frames in CHUNKS for row in measure(clients, args, latent_frames)]
    size = f"{args.height}x{args.width} latents"
    print("# tiny-wan: seeded random weights, it decodes noise")
    print_table(
        f"A session's chunk by transport, {size}, {args.rounds} rounds (ms, p50; frames equal)",
        ["latent frames", "transport", "round trip", "replica (queue+decode+encode)", "added", "added vs WebSocket"],
        rows,
    )


if __name__ == "__main__":
    main()
