"""Fuzz a local service (loopback only; bounded by --examples): hostile and careless msgpack
/decode bodies (tests/fuzzing.py) and /remote-decode queries, then /health. Prints the answers by
status and error type; a 5xx anywhere is a bug (exit status 1).
Usage: python bench/fuzz.py [--examples 20000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import httpx
from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import local_serve, print_table

from tests.fuzzing import decode_bodies, remote_decode_queries
from vae_service_client.messages import MSGPACK


def fuzz(http: httpx.Client, url: str, examples: int, seed_value: int, counts: collections.Counter) -> None:
    def record(r: httpx.Response) -> None:
        kind = r.json()["error"]["type"] if r.status_code >= 400 and r.status_code < 500 else ""
        counts[(r.status_code, kind)] += 1

    config = settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))

    @seed(seed_value)
    @config
    @given(body=decode_bodies())
    def decode(body: bytes) -> None:
        record(http.post(f"{url}/decode", content=body, headers={"content-type": MSGPACK}))

    @seed(seed_value)
    @settings(config, max_examples=max(1, examples // 5))
    @given(case=remote_decode_queries())
    def remote(case) -> None:
        params, body, content_type = case
        record(http.post(f"{url}/remote-decode", params=params, content=body, headers={"content-type": content_type}))

    decode()
    remote()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=20000, help="msgpack bodies (plus a fifth as many queries)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from ray import serve

    from vae_service.serving.app import decoder_app

    counts: collections.Counter = collections.Counter()
    with local_serve() as base, httpx.Client(timeout=60) as http:
        serve.run(decoder_app({"model": "tiny-kl", "model_name": "kl"}), name="fuzz", route_prefix="/fuzz")
        start = time.perf_counter()
        fuzz(http, f"{base}/fuzz", args.examples, args.seed, counts)
        elapsed = time.perf_counter() - start
        healthy = http.get(f"{base}/fuzz/health").json()["status"] == "ok"
    total = sum(counts.values())
    server_errors = sum(n for (status, _), n in counts.items() if status >= 500)
    rows = [[status, kind or "-", n] for (status, kind), n in sorted(counts.items())]
    print_table(
        f"{total} fuzzed requests in {elapsed:.0f} s; 5xx: {server_errors}; healthy after: {healthy}",
        ["status", "error type", "count"],
        rows,
    )
    sys.exit(1 if server_errors or not healthy else 0)


if __name__ == "__main__":
    main()
