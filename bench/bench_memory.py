"""The memory plan against real decodes: per preset, tier and size, the engine's estimate of a
request's peak next to what decoding it held (CPU: live tensor bytes, counted as the estimate
counts them; CUDA: the allocator's peak), and a tiled `high` decode's peak next to its bound.

  python bench/bench_memory.py --cases sd:256x384 sd:512x512 wan2.1:160x224:3 --device cpu
"""

from __future__ import annotations

import argparse

import torch

from bench._common import print_table
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.pricing.memory import LiveBytes

MIB = 2**20


def parse_case(case: str) -> tuple[str, int, int, int]:
    model, size, *frames = case.split(":")
    height, width = (int(v) for v in size.split("x"))
    return model, height, width, int(frames[0]) if frames else 1


def measured_peak(engine: DecodeEngine, request: DecodeRequest) -> tuple[int, int, bool]:
    """(estimate, measured peak, tiled) of one decode, after a first one (folded weights built)."""
    prepared = engine.prepare(request)
    engine.decode([prepared])
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        (result,) = engine.decode([prepared])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        live = LiveBytes()
        with live:
            (result,) = engine.decode([prepared])
        peak = live.peak
    return engine.peak_bytes(prepared), peak, result.tiled


def rows_for(case: str, device: str, precision: str, fraction: float) -> list[list]:
    model, height, width, frames = parse_case(case)
    engine = DecodeEngine(ServiceConfig(model=model, device=device, decode_precision=precision))
    scale = engine.spec.spatial_scale
    dims = (frames,) if engine.video else ()
    z = torch.randn(1, engine.spec.latent_channels, *dims, height // scale, width // scale)
    rows = []
    for quality in ("lossless", "high"):
        request = DecodeRequest(z, quality=quality, latents_scaled=True)
        estimate, peak, _ = measured_peak(engine, request)
        priced = engine.cost.tiers[quality].describe()["priced"]
        rows.append([model, f"{height}x{width}x{frames}", quality, priced, estimate / MIB, peak / MIB,
                     estimate / peak, "-", "-"])  # fmt: skip
    request = DecodeRequest(z, quality="high", latents_scaled=True)
    bound = int(fraction * engine.peak_bytes(engine.prepare(request)))
    engine.limits = Limits(max_decode_bytes=bound)
    _, peak, tiled = measured_peak(engine, request)
    engine.limits = Limits()
    rows.append([model, f"{height}x{width}x{frames}", "high tiled", "-", bound / MIB, peak / MIB, bound / peak,
                 "yes" if tiled else "no", "yes" if peak <= bound else "NO"])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["sd:256x384", "flux:320x256", "wan2.1:160x224:3"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--tiled-fraction", type=float, default=0.5, help="tiled row: bound = this x estimate")
    args = parser.parse_args()
    rows = [row for case in args.cases for row in rows_for(case, args.device, args.precision, args.tiled_fraction)]
    header = ["model", "size", "tier", "priced", "estimate / bound MiB", "peak MiB", "ratio", "tiled", "within"]
    print_table(f"Memory plan vs real decodes ({args.device}, {args.precision})", header, rows)
    missed = [row for row in rows if row[8] == "NO" or (row[7] == "-" and not 0.9 <= row[6] <= 1.1)]
    if missed:  # an estimate off by more than 10%, or a tiled peak over its bound
        raise SystemExit(f"memory plan missed: {missed}")


if __name__ == "__main__":
    main()
