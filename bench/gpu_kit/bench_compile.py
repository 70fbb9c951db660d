"""diffusers' own decode of a preset, eager vs its decoder under torch.compile, beside the service's
`high` tier on the same latents (batch 1, median per decode): the step the GPU check runs last,
with what budget is left (torch.compile's first call compiles, tens of seconds per model and size).
Usage: python bench/gpu_kit/bench_compile.py --device cuda --precision bf16 --cases sd:1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import print_table

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.models.loading import load_vae

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timed(fn, device: torch.device, repeat: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run_case(case: str, device: torch.device, precision: str, repeat: int, mode: str) -> list:
    model, size = case.split(":")
    height, width = (int(v) for v in size.split("x")) if "x" in size else (int(size), int(size))
    engine = DecodeEngine(ServiceConfig(model=model, device=str(device), decode_precision=precision))
    if engine.spec.family != "image" or engine.spec.path != "image_kl":
        raise SystemExit(f"{case}: image KL presets only (sd, flux, flux2), not {engine.spec.path}")
    scale = engine.spec.spatial_scale
    z = torch.randn(1, engine.spec.latent_channels, height // scale, width // scale)
    prepared = engine.prepare(DecodeRequest(z, quality="high", output="float", latents_scaled=True))
    engine.decode([prepared])  # warm-up, folds built
    high_s, high = timed(lambda: engine.decode([prepared])[0].output, device, repeat)
    vae = load_vae(model).vae.to(device, DTYPES[precision])
    zd = z.to(device, DTYPES[precision])
    with torch.inference_mode():
        vae.decode(zd)  # warm-up (cuDNN)
        eager_s, eager = timed(lambda: vae.decode(zd).sample, device, repeat)
        vae.decoder = torch.compile(vae.decoder, mode=mode)
        compile_s, _ = timed(lambda: vae.decode(zd).sample, device, 1)
        compiled_s, compiled = timed(lambda: vae.decode(zd).sample, device, repeat)
    diff = (compiled.float() - eager.float()).abs().max().item()
    high_diff = (high.to(device).float() - eager.float()).abs().max().item()
    torch._dynamo.reset()
    return [model, f"{height}x{width}", precision, eager_s * 1e3, compile_s, compiled_s * 1e3, eager_s / compiled_s,
            high_s * 1e3, eager_s / high_s, f"{diff:.1e}", f"{high_diff:.1e}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["sd:1024"], help="preset:size, image KL presets")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mode", default="default", help="torch.compile mode (default, max-autotune-no-cudagraphs)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, torch.compile mode {args.mode!r}")
    rows = []
    for case in args.cases:
        rows.append(run_case(case, device, args.precision, args.repeat, args.mode))
        print(f"  done {case}", flush=True)
    print_table(
        "diffusers' decode eager vs torch.compile'd decoder vs our high (median per decode, batch 1)",
        ["model", "size", "precision", "eager ms", "compile s (first call)", "compiled ms", "compiled speed-up",
         "high ms", "high speed-up", "max |compiled - eager|", "max |high - eager|"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
