"""Offline decode throughput, one run, side by side on this machine: the same latents files
decoded (1) through the HTTP service (POST /decode, PNG answers written to disk by the client,
`--clients` requests in flight) and (2) by `vae-service batch-decode` on Ray Data (PNG files
written by the engines), with the same number of engines and CPU threads each. Prints items/s of
both and their ratio; the batch job's items/s is given for the whole job (actor start-up and model
load included) and from its first output on, the service's from the first request (its replica
was already up).

Presets use seeded random weights (they decode noise); timings do not depend on the weights.
Usage: python bench/bench_batch.py [--model sd] [--size 128] [--items 32] [--engines 1] [--threads 2]
"""

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table


def write_inputs(folder: Path, shape: list[int], items: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(items):
        paths.append(folder / f"z{i:04d}.npy")
        np.save(paths[-1], rng.standard_normal(shape).astype(np.float32))
    return paths


def through_http(url: str, paths: list[Path], out: Path, clients: int) -> float:
    from vae_service_client import VaeClient

    out.mkdir()
    with VaeClient(url, timeout=600) as client:

        def one(path: Path) -> None:
            png = client.decode(np.load(path), "lossless", "png").output[0]
            (out / f"{path.stem}.png").write_bytes(png)

        one(paths[0])  # warm-up (the first decode of a replica allocates)
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, paths))
        return len(paths) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="sd")
    parser.add_argument("--size", type=int, default=128, help="output pixels per side")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--engines", type=int, default=1, help="Serve replicas = batch actors")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per engine")
    parser.add_argument("--clients", type=int, default=4, help="HTTP requests in flight")
    args = parser.parse_args()

    from ray import serve

    from vae_service.batch import decode_dataset, read_inputs
    from vae_service.serving.app import decoder_app
    from vae_service_client import VaeClient

    config = {"model": args.model, "cpu_threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp, local_serve() as url:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        serve.run(decoder_app(config, num_replicas=args.engines), name="vae", route_prefix="/")
        with VaeClient(url) as client:  # the geometry the replica traced, not config fields
            geometry = client.health()["geometry"]
        side = max(geometry["min_latent_side"], args.size // geometry["spatial_scale"])
        frames = [geometry.get("min_latent_frames", 1)] if "T" in geometry["latent_layout"] else []
        shape = [1, geometry["latent_channels"], *frames, side, side]
        paths = write_inputs(tmp / "in", shape, args.items)
        http = through_http(url, paths, tmp / "http", args.clients)
        serve.delete("vae")
        start = time.perf_counter()
        ds = decode_dataset(read_inputs(tmp / "in"), config, tmp / "batch", concurrency=args.engines, num_cpus=0)
        done = []
        for row in ds.iter_rows():
            assert row["status"] == "decoded", row
            done.append(time.perf_counter())
        batch = args.items / (done[-1] - start)
        steady = (args.items - 1) / (done[-1] - done[0])  # after the first output: engines loaded
        same = all((tmp / "http" / p.name).read_bytes() == p.read_bytes() for p in (tmp / "batch").iterdir())
    print_table(
        f"{args.model} {shape} -> {args.size} px PNG, lossless, {args.items} items, {args.engines} engine(s) x "
        f"{args.threads} thread(s)",
        ["path", "items/s", "vs HTTP"],
        [
            ["HTTP service", http, 1.0],
            ["batch-decode, whole job", batch, batch / http],
            ["batch-decode, after its first output", steady, steady / http],
        ],
    )
    print(f"\nbatch-decode files byte-identical to the service's answers: {same}")


if __name__ == "__main__":
    main()
