"""png vs uint8 throughput through the replica core (DecodeService, in-process), batches of
`--batch` items at `--concurrency` requests in flight: with encoding off the device thread the
two should be close (target on an H200 at 1024 px, batch 8, concurrency 16: within 1.3x).
Usage: python bench/bench_encode.py [--model tiny-kl] [--size 256] [--seconds 20] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest
from vae_service.serving.decode_service import DecodeService


async def images_per_s(service: DecodeService, z: torch.Tensor, output: str, concurrency: int, seconds: float) -> float:
    done, end = 0, time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await service.decode(DecodeRequest(z, quality="high", output=output))
            done += z.shape[0]

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-kl")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    service = DecodeService(
        ServiceConfig(model=args.model, device=args.device, batching={"max_batch_size": args.batch})
    )
    lat = args.size // service.engine.spec.spatial_scale
    z = torch.randn(1, service.engine.spec.latent_channels, lat, lat, generator=torch.Generator().manual_seed(0))
    asyncio.run(images_per_s(service, z, "png", args.concurrency, 2))  # warm-up
    rates = {}
    for output in ("uint8", "png", "uint8", "png"):  # interleaved: noise hits both alike
        rate = asyncio.run(images_per_s(service, z, output, args.concurrency, args.seconds / 2))
        rates.setdefault(output, []).append(rate)
    uint8, png = (sum(rates[o]) / len(rates[o]) for o in ("uint8", "png"))
    print_table(
        f"{args.model} {args.size} px, `high`, batches up to {args.batch}, {args.concurrency} requests in "
        f"flight, {service.engine.device} ({service.config.encoding.threads} encoder threads)",
        ["uint8 images/s", "png images/s", "uint8 / png (target <= 1.3)"],
        [[uint8, png, uint8 / png]],
    )


if __name__ == "__main__":
    main()
