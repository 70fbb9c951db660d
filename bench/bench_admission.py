"""What a request costs before it is refused, over HTTP on a local Serve (one run, side by side):

1. a CogVideoX request (a decoder without a linear frame law) for ~1000 latent frames, refused
   413 by `limits.max_frames`: its round trip (target under 50 ms);
2. a 1024 px `lossless` request of tiny-kl above the memory bound, priced by the class's tiled
   decode and refused 413 because even that does not fit (`limits.max_decode_bytes` set small):
   its round trip, the price included (target under 100 ms);
3. `/health` round trips (p50, p99) while 8 requests like (2), of 8 shapes, arrive at once (target p99
   under 50 ms).

Each model is a tiny diffusers VAE (tests/zoo.py configs with their random initialisation: they
decode noise), saved to a temp folder and served as a real deployment. Uses only the HTTP API and
ServiceConfig fields that every version has, so the same script measures an older checkout:
`python bench/bench_admission.py` from that checkout's root, with its own venv.
Usage: python bench/bench_admission.py [--frames 1000] [--rounds 5] [--bursts 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import local_serve, print_table

from vae_service_client.messages import MSGPACK, pack, request_map

SMALL_BOUND = 2 * 2**20  # bytes: under what even the class's tiled decode of 1024 px needs


def deploy(folder_kl: Path, folder_cog: Path) -> None:
    from ray import serve

    from vae_service.serving.app import decoder_app

    fast = dict(graceful_shutdown_wait_loop_s=0.05, graceful_shutdown_timeout_s=0.5)
    kl = {"model": str(folder_kl), "cpu_threads": 1, "limits": {"max_decode_bytes": SMALL_BOUND}}
    cog = {"model": str(folder_cog), "cpu_threads": 1}
    serve.run(decoder_app(kl, **fast), name="kl", route_prefix="/kl")
    serve.run(decoder_app(cog, **fast), name="cog", route_prefix="/cog")


def post_ms(http: httpx.Client, url: str, latents: np.ndarray, quality: str = "lossless") -> tuple[float, int]:
    body = pack(request_map(latents, quality=quality))
    start = time.perf_counter()
    answer = http.post(url, content=body, headers={"content-type": MSGPACK}, timeout=600)
    return (time.perf_counter() - start) * 1e3, answer.status_code


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bursts", type=int, default=5)
    args = parser.parse_args()
    from tests.models import build_full_vae
    from tests.zoo import BY_NAME, build

    with tempfile.TemporaryDirectory() as tmp, local_serve() as url:
        kl_dir, cog_dir = Path(tmp, "kl"), Path(tmp, "cog")
        build_full_vae("kl").save_pretrained(kl_dir)
        build(BY_NAME["cogvideox"], seed=1).save_pretrained(cog_dir)
        deploy(kl_dir, cog_dir)
        rng = np.random.default_rng(0)
        long_clip = rng.standard_normal((1, 4, args.frames, 2, 2), dtype=np.float32)
        large = rng.standard_normal((1, 4, 128, 128), dtype=np.float32)  # 1024 px at 8x
        rows = []
        with httpx.Client() as http:
            for label, path, z in (
                (f"CogVideoX, {args.frames} latent frames (max_frames)", "/cog/decode", long_clip),
                ("tiny-kl 1024 px lossless above the bound (priced)", "/kl/decode", large),
            ):
                times, statuses = [], set()
                for _ in range(args.rounds):
                    ms, status = post_ms(http, url + path, z)
                    times.append(ms)
                    statuses.add(status)
                rows.append([label, sorted(statuses), min(times), statistics.median(times), max(times)])
            print_table("Requests refused 413: round trip (ms)", ["request", "status", "min", "p50", "max"], rows)

            health: list[tuple[float, float]] = []  # (when, round trip ms)
            stop = threading.Event()

            def probe() -> None:
                with httpx.Client() as client:
                    while not stop.is_set():
                        start = time.perf_counter()
                        client.get(url + "/kl/health", timeout=600)
                        health.append((start, (time.perf_counter() - start) * 1e3))
                        time.sleep(0.005)

            prober = threading.Thread(target=probe)
            prober.start()
            time.sleep(1.0)
            idle = sorted(ms for _, ms in health)
            windows, bursts = [], []
            for burst in range(args.bursts):
                # eight shapes near 1024 px, none priced before: a price cached per shape would hide its cost
                shapes = [
                    rng.standard_normal((1, 4, 128, 126 - 2 * i - 16 * burst), dtype=np.float32) for i in range(8)
                ]
                clients = [httpx.Client() for _ in shapes]
                workers = [
                    threading.Thread(target=post_ms, args=(c, url + "/kl/decode", z))
                    for c, z in zip(clients, shapes, strict=True)
                ]
                start = time.perf_counter()
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                end = time.perf_counter()
                bursts.append(end - start)
                windows.append((start, end))
                time.sleep(0.5)
            stop.set()
            prober.join()
            during = sorted(ms for when, ms in health if any(a <= when <= b for a, b in windows)) or [float("nan")]

            def p99(samples: list[float]) -> float:
                return samples[min(len(samples) - 1, int(0.99 * len(samples)))]

            print_table(
                f"/health while 8 such requests arrive at once ({args.bursts} bursts)",
                ["when", "burst s (max)", "health calls", "p50 ms", "p99 ms", "max ms"],
                [
                    ["idle", "-", len(idle), statistics.median(idle), p99(idle), idle[-1]],
                    ["during a burst", max(bursts), len(during), statistics.median(during), p99(during), during[-1]],
                ],
            )


if __name__ == "__main__":
    main()
