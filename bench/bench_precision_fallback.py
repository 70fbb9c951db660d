"""What the fp32 fallback of fp16/bf16 deployments costs (engine/execution/fallback.py), in one process.

1. Nothing overflows: an fp16/bf16 engine checks every output for NaN/Inf whether the fallback is
   on or off (it did before the fallback existed), so the fallback should add nothing until that
   check fails. Two engines of the same model and precision, `precision_fallback` on and off,
   decode the same latents; rounds alternate which goes first (AB BA AB ...) so that drift and
   warm caches hit both alike, for `--seconds` per case; medians and on / off (and the ratio of the
   fastest samples, the least disturbed by other processes). Each timed sample repeats the decode
   until it lasts `--min-sample-s`, so that tiny models are not timed at the clock's grain. bf16 is the
   realistic CPU case (fp16 convolutions on CPU are slow; fp16 is run for a tiny model only).
2. An item overflows: tests/models.py's overflowing tiny KL (its first conv scaled so that latents
   times OVERFLOW_LATENTS overflow fp16 while fp32 stays finite), saved to a temporary folder and
   loaded from there by every engine. The fp16 engine's first decode of such latents loads the
   fp32 copy and decodes again; the copy is then released (as on scale-down) and the first
   decode timed again each round (a warm page cache: the load is from memory). The
   later decodes find it loaded. Beside them: the fp32 deployment's `lossless` decode of the same
   latents (what the fallback's answer must equal bit for bit, checked), the fp16 decode of
   finite latents (what the fp16 deployment pays without an overflow) and the fp16 decode of the
   overflowing latents with the fallback off (its 422: the fp16 work the fallback comes after).

Presets use seeded random weights (they decode noise); speed does not depend on the weights.
Usage: python bench/bench_precision_fallback.py [--cases tiny-kl:bf16:256x256 tiny-wan:bf16:128x224:5 ...]
       [--seconds 25] [--min-sample-s 0.3] [--quality high] [--overflow-size 256x256] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/models.py
from _common import print_table

from tests.models import OVERFLOW_LATENTS, overflowing_vae, save_vae
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.request.result import DecodeResult


def parse_case(case: str) -> tuple[str, str, int, int, int | None]:
    model, precision, size, *frames = case.split(":")
    height, width = (int(v) for v in size.split("x"))
    return model, precision, height, width, int(frames[0]) if frames else None


def make_engine(model: str, precision: str, threads: int, fallback: bool = True) -> DecodeEngine:
    config = ServiceConfig(
        model=model,
        decode_precision=precision,
        precision_fallback=fallback,
        device="cpu",
        cpu_threads=threads,
        serving={"fit_prices_at_start": False},
    )
    return DecodeEngine(config)


def latents_for(engine: DecodeEngine, height: int, width: int, frames: int | None, seed: int = 0) -> torch.Tensor:
    scale = engine.spec.spatial_scale
    dims = (height // scale, width // scale) if frames is None else (frames, height // scale, width // scale)
    return torch.randn(1, engine.spec.latent_channels, *dims, generator=torch.Generator().manual_seed(seed))


def decode(engine: DecodeEngine, z: torch.Tensor, quality: str) -> DecodeResult:
    result = engine.decode([engine.prepare(DecodeRequest(z, quality, "uint8"))])[0]
    # an error comes back as a value, not raised; only the engine with the fallback off may refuse
    if not isinstance(result, DecodeResult) and engine.fallback.enabled:
        raise SystemExit(f"{engine.spec.name}: {result!r}")
    return result


def timed(engine: DecodeEngine, z: torch.Tensor, quality: str, inner: int, before=None) -> tuple[float, DecodeResult]:
    """Seconds per decode over `inner` decodes in a row (`before()` ahead of each), and the last result."""
    start = time.perf_counter()
    for _ in range(inner):
        if before is not None:
            before()
        result = decode(engine, z, quality)
    return (time.perf_counter() - start) / inner, result


def repeats(sample, min_sample_s: float) -> int:
    """Decodes per timed sample: `sample()` (seconds of one decode) once to warm up, once to time."""
    sample()
    return max(1, round(min_sample_s / sample()))


def size_label(engine: DecodeEngine, height: int, width: int, frames: int | None) -> str:
    return f"{height}x{width}" + ("" if frames is None else f" x {engine.spec.output_frames(frames)} frames")


def overhead_case(case: str, quality: str, args: argparse.Namespace) -> tuple[list, list]:
    model, precision, height, width, frames = parse_case(case)
    engines = {
        "off": make_engine(model, precision, args.threads, False),
        "on": make_engine(model, precision, args.threads),
    }
    z = latents_for(engines["on"], height, width, frames)
    inner = max(repeats(lambda e=engine: timed(e, z, quality, 1)[0], args.min_sample_s) for engine in engines.values())
    times, fell_back, end = {"off": [], "on": []}, 0, time.perf_counter() + args.seconds
    rounds = 0
    while rounds < args.min_rounds or (time.perf_counter() < end and rounds < args.max_rounds):
        for name in ("off", "on") if rounds % 2 == 0 else ("on", "off"):
            seconds, result = timed(engines[name], z, quality, inner)
            times[name].append(seconds)
            fell_back += len(result.fallback)
        rounds += 1
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    described = engines["on"].describe()
    fallback = described["precision_fallback"]
    timing = [model, size_label(engines["on"], height, width, frames), precision, f"{rounds} x {inner}",
              off, on, on / off, min(times["on"]) / min(times["off"]), fell_back]  # fmt: skip
    plan = [model, precision, str(fallback["enabled"]), fallback["reserved_bytes"] / 2**20,
            described["memory_plan"]["fallback_bytes"] / 2**20, str(fallback["loaded"]), fallback["items"],
            engines["off"].describe()["memory_plan"]["fallback_bytes"] / 2**20]  # fmt: skip
    return timing, plan


def overflow_case(height: int, width: int, quality: str, args: argparse.Namespace) -> tuple[list, dict]:
    with tempfile.TemporaryDirectory(prefix="overflow-kl-") as folder:
        save_vae(overflowing_vae("kl"), Path(folder))
        fp16, fp32 = make_engine(folder, "fp16", args.threads), make_engine(folder, "fp32", args.threads)
        refusing = make_engine(folder, "fp16", args.threads, fallback=False)
        finite = latents_for(fp16, height, width, None)
        z = finite * OVERFLOW_LATENTS
        # the fp32 copy goes, as on scale-down (`release_folded` would drop the fast path's folded
        # weights too, and the next decode would pay for folding them again)
        drop = fp16.fallback.release
        kinds = {  # name: (engine, latents, quality, before each decode)
            "finite": (fp16, finite, quality, None),
            "first": (fp16, z, quality, drop),
            "later": (fp16, z, quality, None),
            "fp32": (fp32, z, "lossless", None),
            "refused": (refusing, z, quality, None),  # the fp16 decode that overflows, alone (its 422)
        }
        inner = {
            name: repeats(lambda k=kind: timed(*k[:3], 1, k[3])[0], args.min_sample_s) for name, kind in kinds.items()
        }
        runs: dict[str, list[float]] = {name: [] for name in kinds}
        identical = True
        for _ in range(args.overflow_rounds):
            results = {}
            for name, (engine, latents, tier, before) in kinds.items():
                seconds, results[name] = timed(engine, latents, tier, inner[name], before)
                runs[name].append(seconds)
            first, later, reference = results["first"], results["later"], results["fp32"]
            identical &= first.fallback == later.fallback == (0,) and results["finite"].fallback == ()
            identical &= not isinstance(results["refused"], DecodeResult)
            identical &= torch.equal(first.output, reference.output) and torch.equal(later.output, reference.output)
        described = fp16.describe()["precision_fallback"]
    med = {key: statistics.median(values) for key, values in runs.items()}
    row = ["overflowing tiny-kl", f"{height}x{width}", "/".join(str(inner[k]) for k in kinds), med["finite"],
           med["refused"], med["first"], med["later"], med["fp32"], med["first"] / med["fp32"],
           med["later"] / med["fp32"], med["later"] - med["refused"], med["first"] - med["later"],
           "yes" if identical else "NO"]  # fmt: skip
    return row, described


def main() -> None:
    parser = argparse.ArgumentParser()
    cases = ["tiny-kl:bf16:256x256", "tiny-kl:fp16:256x256", "tiny-wan:bf16:128x224:5", "sd:bf16:256x256"]
    parser.add_argument("--cases", nargs="*", default=cases, help="model:precision:HxW[:latent frames]")
    parser.add_argument("--seconds", type=float, default=25, help="rounds run this long per case, warm-up aside")
    parser.add_argument("--min-rounds", type=int, default=4)
    parser.add_argument("--max-rounds", type=int, default=50)
    parser.add_argument("--min-sample-s", type=float, default=0.3, help="a timed sample repeats decodes this long")
    parser.add_argument("--quality", default="high")
    parser.add_argument("--overflow-size", default="256x256", help="pixels of the overflow case; empty: skip it")
    parser.add_argument("--overflow-rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, cpu, {args.threads} torch threads, {os.cpu_count()} cores, `{args.quality}`")
    timings, plans = [], []
    for case in args.cases:
        start = time.perf_counter()
        timing, plan = overhead_case(case, args.quality, args)
        timings.append(timing)
        plans.append(plan)
        print(f"  done {case} in {time.perf_counter() - start:.0f} s", flush=True)
    if timings:
        print_table(
            "nothing overflows: fallback off vs on, batch 1 (median s per decode)",
            [
                "model",
                "size",
                "precision",
                "rounds x decodes",
                "off s",
                "on s",
                "on / off",
                "min on / min off",
                "items fell back",
            ],
            timings,
        )
        print_table(
            "the fallback as the engine describes it, after those rounds (describe()['precision_fallback'])",
            ["model", "precision", "enabled", "reserved MiB", "memory_plan fallback MiB", "fp32 copy loaded",
             "items", "fallback off: plan MiB"],
            plans,
        )  # fmt: skip
    if args.overflow_size:
        start = time.perf_counter()
        height, width = (int(v) for v in args.overflow_size.split("x"))
        row, described = overflow_case(height, width, args.quality, args)
        print(f"  done the overflow case in {time.perf_counter() - start:.0f} s", flush=True)
        print_table(
            f"an item overflows fp16: its decode with the fallback vs the fp32 deployment's `lossless` "
            f"(median s of {args.overflow_rounds} rounds; fp16 `{args.quality}`)",
            ["model", "size", "decodes per sample", "fp16 finite s", "fp16 overflow, fallback off (422) s",
             "fp16, first fallback s (loads fp32)", "fp16, later fallbacks s", "fp32 lossless s", "first / fp32",
             "later / fp32", "fallback's work: later - off s", "fp32 load: first - later s",
             "fallback == fp32 lossless"],
            [row],
        )  # fmt: skip
        print(f"fp16 engine's describe()['precision_fallback'] at the end: {described}")


if __name__ == "__main__":
    main()
