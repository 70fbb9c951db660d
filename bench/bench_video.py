"""Causal video decoders (Wan2.1, Wan2.2, Qwen-Image) side by side in one process: diffusers' own
decode vs our `lossless` (the engine's bit-identical walk) vs `high`, the time to the first
streamed chunk, and decode memory untiled vs tiled.

Rounds interleave the configurations so machine noise hits all alike; medians are printed.
Presets use seeded random weights (they decode noise); speed does not depend on the weights.
Usage: python bench/bench_video.py [--cases tiny-wan:240x416:2 wan2.1:240x416:2] [--rounds 2]
       [--device cuda --precision bf16] [--memory wan2.1:480x832:21 ...] [--bound-gib 8]
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

from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.pricing.memory import LiveBytes
from vae_service.models.wan_internals import diffusers_chunks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def parse_case(case: str) -> tuple[str, int, int, int]:
    model, size, frames = case.split(":")
    height, width = (int(v) for v in size.split("x"))
    return model, height, width, int(frames)


def make_engine(model: str, device: str, precision: str) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model=model, device=device, decode_precision=precision))


def latents_for(engine: DecodeEngine, height: int, width: int, frames: int) -> torch.Tensor:
    scale = engine.spec.spatial_scale
    z = torch.randn(1, engine.spec.latent_channels, frames, height // scale, width // scale)
    return z.to(engine.device, engine.dtype)


def speed_case(case: str, device: str, precision: str, rounds: int) -> list:
    model, height, width, frames = parse_case(case)
    engine = make_engine(model, device, precision)
    z = latents_for(engine, height, width, frames)
    gate = engine.fast_path.gate

    def stock():
        """diffusers' decoder forward per latent frame with its feature cache, as `_decode` runs it
        (`vae.decode` itself needs the encoder, which a decode service never loads, for Qwen-Image)."""
        with gate.use(False):
            return torch.cat(list(diffusers_chunks(engine.vae, z)), 2)

    def ours(quality):
        def run():
            first, chunks, start = None, [], time.perf_counter()
            with gate.use(quality == "high"):
                for chunk in engine.runtime.chunks(quality, None)(z):
                    if first is None:
                        _sync(engine.device)
                        first = time.perf_counter() - start
                    chunks.append(chunk)
            run.first.append(first)
            return torch.cat(chunks, 2)

        run.first = []
        return run

    runs = {"stock": stock, "lossless": ours("lossless"), "high": ours("high")}
    times = {name: [] for name in runs}
    outputs = {}
    with torch.inference_mode():
        for i in range(rounds + 1):  # the first round warms up
            for name, run in runs.items():
                _sync(engine.device)
                start = time.perf_counter()
                outputs[name] = run()
                _sync(engine.device)
                if i:
                    times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    first = statistics.median(runs["lossless"].first[1:])
    identical = torch.equal(outputs["lossless"], outputs["stock"])
    err = (outputs["high"].float() - outputs["stock"].float()).abs().max().item()
    return [
        model,
        f"{height}x{width} x {engine.spec.output_frames(frames)} frames",
        engine.precision,
        med["stock"],
        med["lossless"],
        med["stock"] / med["lossless"],
        "yes" if identical else "NO",
        med["high"],
        med["stock"] / med["high"],
        f"{err:.1e}",
        first,
        first / med["lossless"],
    ]


def peak_bytes(engine: DecodeEngine, z: torch.Tensor, bound: int | None) -> tuple[int, bool, int]:
    """(peak live tensor bytes of one `high` uint8 decode, tiled?, estimate the plan used)."""
    engine.limits = Limits(max_decode_bytes=bound)
    request = engine.prepare(DecodeRequest(z.cpu().float(), quality="high", latents_scaled=True))
    live = LiveBytes()
    with live:
        result = engine.decode([request])[0]
    engine.limits = Limits()
    return live.peak, result.tiled, engine.peak_bytes(request)


def measured_memory(case: str, device: str, precision: str, fraction: float) -> list:
    model, height, width, frames = parse_case(case)
    engine = make_engine(model, device, precision)
    z = latents_for(engine, height, width, frames)
    untiled, _, estimate = peak_bytes(engine, z, None)
    bound = int(fraction * estimate)
    tiled, was_tiled, _ = peak_bytes(engine, z, bound)
    mib = 2**20
    return [
        model,
        f"{height}x{width} x {engine.spec.output_frames(frames)} frames",
        estimate / mib,
        untiled / mib,
        bound / mib,
        tiled / mib,
        "yes" if was_tiled else "no",
        tiled / untiled,
    ]


def planned_memory(case: str, precision: str, bound_gib: float) -> list:
    """What the engine plans for a size too large to decode here: its estimate and its tiles."""
    model, height, width, frames = parse_case(case)
    engine = make_engine(model, "cpu", precision if precision != "auto" else "fp32")
    scale = engine.spec.spatial_scale
    z = torch.zeros(1, engine.spec.latent_channels, frames, height // scale, width // scale)
    request = DecodeRequest(z, quality="high", latents_scaled=True)
    bound = int(bound_gib * 2**30)
    unlimited = dict(max_output_pixels=2**40, max_decode_tflop=1e9, max_request_bytes=2**40)
    engine.limits = Limits(**unlimited, max_decode_bytes=2**62)
    need = engine.peak_bytes(engine.prepare(request))
    engine.limits = Limits(**unlimited, max_decode_bytes=bound)
    grid = engine.prepare(request).tiling
    order = "-" if grid is None else ("lockstep" if grid.lockstep else "tile after tile")
    tiles = "-" if grid is None else f"{len(grid.tiles())} x {grid.tile * scale} px"
    return [model, f"{height}x{width} x {engine.spec.output_frames(frames)} frames", engine.precision,
            need / 2**30, bound_gib, tiles, order]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--cases",
        nargs="*",
        default=["tiny-wan:240x416:2", "tiny-wan2.2:240x416:2", "wan2.1:240x416:2", "qwen-image:256x256:1"],
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--measure-memory", nargs="*", default=["tiny-wan:480x832:3"])
    parser.add_argument("--tiled-fraction", type=float, default=0.6, help="bound for the tiled run, x the estimate")
    parser.add_argument("--memory", nargs="*", default=["wan2.1:480x832:21", "wan2.1:720x1280:21"])
    parser.add_argument("--bound-gib", type=float, default=8.0)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads")
    rows = []
    for case in args.cases:
        rows.append(speed_case(case, args.device, args.precision, args.rounds))
        print(f"  done {case}", flush=True)
    print_table(
        "causal video decode, batch 1 (median s): diffusers vs our lossless (bit-identical) vs high",
        ["model", "size", "precision", "diffusers s", "lossless s", "lossless speed-up", "bit-identical",
         "high s", "high speed-up", "max |high - diffusers|", "first chunk s", "first / whole"],
        rows,
    )  # fmt: skip
    if args.measure_memory:
        print_table(
            f"decode memory, `high` (peak live tensor bytes, MiB): untiled vs a bound of "
            f"{args.tiled_fraction:g} x the estimate",
            ["model", "size", "estimate", "untiled", "bound", "tiled", "tiled?", "tiled / untiled"],
            [measured_memory(c, args.device, args.precision, args.tiled_fraction) for c in args.measure_memory],
        )
    if args.memory:
        print_table(
            "planned: estimated peak of an untiled decode and the tiles for the bound (no decode)",
            ["model", "size", "precision", "estimate GiB", "bound GiB", "tiles", "order"],
            [planned_memory(c, args.precision, args.bound_gib) for c in args.memory],
        )


if __name__ == "__main__":
    main()
