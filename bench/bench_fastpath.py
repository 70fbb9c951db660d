"""`high` (fast path) vs `lossless` decode time, side by side in one process, with fidelity.

Runs interleave the two tiers so machine noise hits both alike. Presets use seeded random
weights (they decode noise); speed does not depend on the weights.
Usage: python bench/bench_fastpath.py [--quick] [--device cuda --precision bf16 --cases sd:1024 ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import ServiceConfig
from vae_service.engine import (
    DecodeEngine,
    DecodeRequest,
)


def psnr_uint8(a: torch.Tensor, b: torch.Tensor) -> float:
    qa, qb = [((x.float() / 2 + 0.5).clamp(0, 1) * 255).round() for x in (a, b)]
    mse = (qa - qb).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(
    model: str, height: int, width: int, frames: int, device: str, precision: str, repeat: int, profile: bool = False
) -> list:
    engine = DecodeEngine(ServiceConfig(model=model, device=device, decode_precision=precision))
    scale = engine.spec.spatial_scale
    video = [frames] if engine.spec.family == "video" else []
    z = torch.randn(
        [1, engine.spec.latent_channels, *video, height // scale, width // scale],
        generator=torch.Generator().manual_seed(0),
    )
    prepared = {q: engine.prepare(DecodeRequest(z, quality=q, output="float")) for q in ("lossless", "high")}
    outputs, times, peaks = {}, {"lossless": [], "high": []}, {}
    for i in range(repeat + 1):  # first round warms up (and builds folded buffers)
        for quality, req in prepared.items():
            _sync(engine.device)
            _reset_peak(engine.device)
            start = time.perf_counter()
            outputs[quality] = engine.decode([req])[0].output
            _sync(engine.device)
            if i:
                times[quality].append(time.perf_counter() - start)
                peaks[quality] = _peak_mib(engine.device)
    if profile:
        with torch.profiler.profile() as prof:
            engine.decode([prepared["high"]])
            _sync(engine.device)
        key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))
    lossless, high = statistics.median(times["lossless"]), statistics.median(times["high"])
    err = (outputs["high"].float() - outputs["lossless"].float()).abs().max().item()
    ratio = "n/a (fp32)" if engine.dtype == torch.float32 else f"{bf16_error_ratio(model, device, z, outputs):.2f}"
    size = f"{height}x{width}" + (f" x {engine.spec.output_frames(frames)} frames" if video else "")
    return [
        model,
        size,
        engine.precision,
        lossless * 1e3,
        high * 1e3,
        lossless / high,
        f"{err:.1e}",
        f"{psnr_uint8(outputs['high'], outputs['lossless']):.1f}",
        ratio,
        peaks["lossless"],
        peaks["high"],
        engine.fast_path.folded.nbytes // 1024,
    ]


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: torch.device) -> float | str:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else "n/a (CPU)"


def throughput(model: str, size: int, batch: int, device: str, precision: str, repeat: int) -> list:
    """`high` images/s for one batch size, and the memory peak of a call."""
    engine = DecodeEngine(ServiceConfig(model=model, device=device, decode_precision=precision))
    lat = size // engine.spec.spatial_scale
    z = torch.randn(batch, engine.spec.latent_channels, lat, lat, generator=torch.Generator().manual_seed(0))
    request = engine.prepare(DecodeRequest(z, quality="high", output="uint8"))
    engine.decode([request])  # warm-up, folds built
    _sync(engine.device)
    _reset_peak(engine.device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        engine.decode([request])
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return [model, size, batch, engine.precision, median * 1e3, batch / median, _peak_mib(engine.device)]


def bf16_error_ratio(model: str, device: str, z: torch.Tensor, outputs: dict) -> float:
    """README's bound for low precision: max |high - fp32| / max |lossless - fp32| (<= 2), against
    the same weights decoded in fp32 with TF32 off."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        exact_engine = DecodeEngine(ServiceConfig(model=model, device=device, decode_precision="fp32"))
        exact = exact_engine.decode([exact_engine.prepare(DecodeRequest(z, output="float"))])[0].output.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    del exact_engine
    errors = {q: (outputs[q].float() - exact).abs().max().item() for q in ("high", "lossless")}
    return errors["high"] / max(errors["lossless"], 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="sd at 256 px only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="measure with torch.backends.cudnn.benchmark on (not what the service runs)",
    )
    parser.add_argument("--profile", action="store_true", help="print the top kernels of one high decode per case")
    parser.add_argument(
        "--cases", nargs="*", help="model:size[:latent_frames], size N or HxW, e.g. sd:1024 wan2.1:480x832:21"
    )
    parser.add_argument("--throughput", nargs="*", default=[], help="model:size for `high` images/s, e.g. sd:1024")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 4, 8])
    args = parser.parse_args()
    cases = args.cases or (
        ["sd:256"] if args.quick else ["sd:256", "sd:512", "flux:256", "flux2:256", "qwen-image:256"]
    )
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads, "
        f"cudnn.benchmark={args.cudnn_benchmark}"
    )
    rows = []
    for case in cases:
        model, size, *frames = case.split(":")
        height, width = (int(v) for v in size.split("x")) if "x" in size else (int(size), int(size))
        rows.append(
            run_case(
                model,
                height,
                width,
                int(frames[0]) if frames else 1,
                args.device,
                args.precision,
                args.repeat,
                args.profile,
            )
        )
        print(f"  done {case}", flush=True)
    print_table(
        "high vs lossless (median per decode, batch 1)",
        [
            "model",
            "size",
            "precision",
            "lossless ms",
            "high ms",
            "speed-up",
            "max |high - lossless|",
            "uint8 PSNR dB",
            "error ratio vs fp32 (<= 2)",
            "lossless peak MiB",
            "high peak MiB",
            "folded KiB",
        ],
        rows,
    )
    if args.throughput:
        rates = [
            throughput(m, int(s), b, args.device, args.precision, args.repeat + 2)
            for m, s in (c.split(":") for c in args.throughput)
            for b in args.batches
        ]
        print_table(
            "high throughput (median per call)",
            ["model", "size", "batch", "precision", "ms per call", "images/s", "peak MiB"],
            rates,
        )


if __name__ == "__main__":
    main()
