"""One request across replicas: a tiled `high` image decoded serially by one replica vs its tiles
spread over N replicas of one deployment (serving/tile_spread.py), side by side in one run on a
local Serve, each replica single-threaded (cpu_threads 1), the same tile plan
(parallel.min_output_pixels). Prints the wall time of each, the speed-up, what the spread costs
over a perfect split (blend, transfers, dispatch), and checks the answers are bit-identical.

Target (issue #20): two single-thread replicas >= 1.6x one on this CPU.
Usage: python bench/bench_parallel.py [--model sd] [--size 256] [--tile-px 128] [--replicas 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, median_s, print_table

from vae_service_client import VaeClient

LATENT_CHANNELS = {"sd": 4, "sdxl": 4, "flux": 16, "tiny-kl": 4}


def deploy(name: str, model: str, tile_px: int, replicas: int, spread: bool, base_url: str) -> str:
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {
        "model": model,
        "model_name": name,
        "device": "cpu",
        "cpu_threads": 1,
        "parallel": {"tiles_across_replicas": spread, "min_output_pixels": tile_px * tile_px},
    }
    scaling = {"min_replicas": replicas, "max_replicas": replicas, "initial_replicas": replicas}
    # no CPU reservation: Ray counts this machine's cores, and the apps' replicas outnumber them
    options = {"autoscaling_config": scaling, "ray_actor_options": {"num_cpus": 0}}
    serve.run(decoder_app(config, **options), name=name, route_prefix=f"/{name}")
    return f"{base_url}/{name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd", choices=sorted(LATENT_CHANNELS))
    parser.add_argument("--size", type=int, default=256, help="output pixels per side")
    parser.add_argument("--tile-px", type=int, default=128, help="parallel.min_output_pixels = tile_px^2")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    side = args.size // 8
    z = torch.randn(1, LATENT_CHANNELS[args.model], side, side, generator=torch.Generator().manual_seed(0))
    with local_serve() as base:
        urls = {
            "one": deploy("serial", args.model, args.tile_px, 1, False, base),
            "spread": deploy("spread", args.model, args.tile_px, args.replicas, True, base),
        }
        answers, seconds = {}, {}
        with VaeClient(urls["one"], timeout=600) as one, VaeClient(urls["spread"], timeout=600) as spread:
            for name, client in (("one", one), ("spread", spread)):
                answers[name] = client.decode(z, quality="high", output="uint8")
                seconds[name] = median_s(lambda c=client: c.decode(z, quality="high", output="uint8"), args.repeat, 0)
    identical = np.array_equal(answers["one"].output, answers["spread"].output)
    speedup = seconds["one"] / seconds["spread"]
    overhead = seconds["spread"] - seconds["one"] / args.replicas
    print_table(
        f"{args.model} {args.size}px `high`, tiles of {args.tile_px}px: one replica vs {args.replicas} "
        f"(cpu_threads 1 each, median of {args.repeat})",
        ["one replica s", f"{args.replicas} replicas s", "speed-up", "overhead s", "replicas used", "identical"],
        [[seconds["one"], seconds["spread"], speedup, overhead, answers["spread"].timing["replicas"], identical]],
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
