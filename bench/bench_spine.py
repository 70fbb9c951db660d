"""Spine benchmark, one run, ratios side by side:

1. in-process engine decode vs HTTP end-to-end (POST /decode through local Serve) for the same
   latent, for tiny-kl and sd at 256 px: what the service layer costs;
2. batch-invariant lossless (each item alone) vs one plain batched `vae.decode`: what the
   lossless guarantee costs, and how far the batched result drifts from the solo decodes.

Presets use seeded random weights (they decode noise); timings do not depend on the weights.
Usage: python bench/bench_spine.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, median_s, print_table  # noqa: E402

from vae_service.config import ServiceConfig  # noqa: E402
from vae_service.engine import DecodeEngine  # noqa: E402
from vae_service.protocol.decode_schema import DecodeParams  # noqa: E402


def service_overhead(models: list[str], repeat: dict[str, int]) -> list[list]:
    from ray import serve

    from vae_service.serving.app import build_app
    from vae_service_client import VaeClient

    rows = []
    with local_serve() as url:
        for model in models:
            engine = DecodeEngine(ServiceConfig(model=model))
            z = torch.randn(1, engine.spec.latent_channels, 32, 32, generator=torch.Generator().manual_seed(0))
            in_process = median_s(lambda e=engine: e.decode([e.prepare(DecodeParams(latents=z))]), repeat[model])
            del engine  # the replica loads its own copy
            serve.run(build_app({"model": model}), name=model, route_prefix=f"/{model}")
            with VaeClient(f"{url}/{model}") as client:
                http = median_s(lambda: client.decode(z), repeat[model])
            serve.delete(model)
            rows.append([model, "1x%dx32x32 -> 256 px uint8" % z.shape[1], in_process * 1e3, http * 1e3,
                         http / in_process, (http - in_process) * 1e3])
    return rows


def lossless_cost(model: str, batch: int, repeat: int) -> list:
    engine = DecodeEngine(ServiceConfig(model=model))
    z = torch.randn(batch, engine.spec.latent_channels, 32, 32, generator=torch.Generator().manual_seed(1))
    vae = engine.vae
    with torch.inference_mode():
        solo = median_s(lambda: torch.cat([vae.decode(i).sample for i in z.split(1)]), repeat)
        batched = median_s(lambda: vae.decode(z).sample, repeat)
        drift = (vae.decode(z).sample - torch.cat([vae.decode(i).sample for i in z.split(1)])).abs().max().item()
    return [model, f"{batch}x{z.shape[1]}x32x32", solo * 1e3, batched * 1e3, solo / batched, f"{drift:.2e}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny-kl only")
    args = parser.parse_args()
    models = ["tiny-kl"] if args.quick else ["tiny-kl", "sd"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU")
    rows = service_overhead(models, {"tiny-kl": 30, "sd": 3})
    print_table("In-process decode vs HTTP end to end (same latent, median)",
                ["model", "input", "in-process ms", "HTTP ms", "HTTP / in-process", "service overhead ms"], rows)
    cost = [lossless_cost("tiny-kl", 8, 10)] + ([] if args.quick else [lossless_cost("sd", 4, 2)])
    print_table("Batch-invariant lossless (each item alone) vs one batched vae.decode",
                ["model", "batch", "lossless ms", "batched ms", "lossless / batched", "batched max |diff| vs solo"], cost)


if __name__ == "__main__":
    main()
