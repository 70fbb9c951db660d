"""What sharing `lossless` above the bound costs and can gain (models/diffusers_tiling.py): the
class's own tiled decode (`vae.enable_tiling(); vae.decode`) run directly vs recorded and replayed
with its decoder's calls made as jobs (here, serially: the replay's own cost), and the share of the
decode its decoder's calls take (what other replicas can take; the rest, the blend, stays on the
request's replica). Answers checked bit for bit. Side by side in one run, medians of --repeat.

Presets use seeded random weights (they decode noise); speed does not depend on the weights.
Usage: python bench/bench_replay.py [--cases sd:640 tiny-kl:576] [--repeat 2] [--device cuda --precision bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.models import load_vae
from vae_service.models.decoder_shapes import DecoderShapes
from vae_service.models.diffusers_tiling import decode_causal_tile, tiled_decode_elsewhere, tiled_view


def timed(fn, repeat: int, device: torch.device):
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def case_row(case: str, repeat: int, device: torch.device, dtype: torch.dtype) -> list:
    model, size = case.split(":")
    vae = torch.nn.Module.to(load_vae(model, name=model, seed=0).vae.eval(), device=device, dtype=dtype)
    view = tiled_view(vae)
    scale = 8
    z = torch.randn(1, vae.config.latent_channels, int(size) // scale, int(size) // scale, device=device, dtype=dtype)
    shapes = DecoderShapes.of(view)
    inputs: list[torch.Tensor] = []

    def jobs(xs, causal):
        inputs[:] = xs
        return [decode_causal_tile(vae, x) if causal else vae.decoder(x) for x in xs]

    with torch.inference_mode():
        direct_s, direct = timed(lambda: view.decode(z).sample, repeat, device)
        replay_s, replayed = timed(lambda: tiled_decode_elsewhere(view, z, jobs, None, shapes), repeat, device)
        calls_s, _ = timed(lambda: [vae.decoder(x) for x in inputs], repeat, device)
    return [
        model,
        f"{size} px",
        len(inputs),
        direct_s,
        replay_s,
        replay_s / direct_s,
        calls_s / direct_s,
        direct_s / (calls_s / 2 + (replay_s - calls_s)),
        torch.equal(direct, replayed),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["sd:640", "tiny-kl:576"], help="preset:size (image KL)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    rows = [case_row(case, args.repeat, device, dtype) for case in args.cases]
    print_table(
        f"`lossless` above the bound: the class's tiled decode direct vs recorded and replayed ({device}, "
        f"{args.precision}, median of {args.repeat})",
        [
            "model",
            "size",
            "decoder calls",
            "direct s",
            "replayed s",
            "replayed / direct",
            "decoder calls' share",
            "2 replicas at best",
            "identical",
        ],
        rows,
    )
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
