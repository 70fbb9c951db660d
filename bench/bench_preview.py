"""`preview` vs `lossless` decode time per model, side by side in one process (CPU by default),
and what the linear preview's start-up fit costs.

Presets use seeded random weights (they decode noise); speed does not depend on the weights, but
a preview's likeness does, so no fidelity is printed here (the tests check the map itself).
Usage: python bench/bench_preview.py [--cases sd:256 flux2:256 wan2.1:256:1 ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import median_s, print_table

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest

DEFAULT_CASES = [
    "sd:256",
    "flux:256",
    "flux2:256",
    "qwen-image:256",
    "wan2.1:256",
    "hunyuan-video:256",
    "ltx-video:256",
]


def run_case(case: str, device: str, repeat: int) -> list:
    model, size, *frames = case.split(":")
    frames = frames or ["1"]
    start = time.perf_counter()
    engine = DecodeEngine(ServiceConfig(model=model, device=device))
    load_s = time.perf_counter() - start
    scale, video = engine.spec.spatial_scale, engine.spec.geometry.video_latents
    shape = [
        1,
        engine.spec.latent_channels,
        *([int(frames[0])] if video else []),
        int(size) // scale,
        int(size) // scale,
    ]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    prepared = {q: engine.prepare(DecodeRequest(z, quality=q)) for q in ("lossless", "preview")}
    times = {q: median_s(lambda p=p: engine.decode([p]), repeat) for q, p in prepared.items()}
    return [
        model,
        f"{size}x{size}",
        times["lossless"] * 1e3,
        times["preview"] * 1e3,
        times["lossless"] / times["preview"],
        engine.describe()["preview"],
        load_s,
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="model:size[:latent_frames]")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads")
    rows = []
    for case in args.cases:
        rows.append(run_case(case, args.device, args.repeat))
        print(f"  done {case}", flush=True)
    print_table(
        "preview vs lossless (median per decode, batch 1, uint8 output)",
        ["model", "size", "lossless ms", "preview ms", "lossless / preview", "preview", "engine start s (fit incl.)"],
        rows,
    )


if __name__ == "__main__":
    main()
