"""Streamed `mp4` vs the whole `mp4` answer through the replica core (DecodeService, in-process):
(a) submit to the first fragment's bytes (the first playable piece: init segment plus the first
latent frame's frames) of `stream=True, output="mp4"`; (b) the whole non-streamed `mp4` answer;
a / b; (c) the encoder's share, encode_ms / (decode_ms + encode_ms), of the whole answer and of
the stream (there the encode overlaps the decode, so its share is of the work, not of the wall
time); (d) the whole `uint8` answer (no encoding), so that mp4's cost over raw frames shows.

Rounds interleave the three requests so machine noise hits all alike; medians are printed. The
streamed fragments joined must be the whole answer's bytes (checked every round).
Presets use seeded random weights (they decode noise, which x264 finds harder than real video,
so the encode share here is an upper side).
Usage: python bench/bench_mp4_stream.py [--cases tiny-wan:128x224:5 wan2.1:64x96:3] [--rounds 3]
       [--quality high] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeRequest
from vae_service.engine.request.result import DecodeResult
from vae_service.serving.decode_service import DecodeService
from vae_service_client.mp4 import Mp4Fragment


def parse_case(case: str) -> tuple[str, int, int, int]:
    model, size, frames = case.split(":")
    height, width = (int(v) for v in size.split("x"))
    return model, height, width, int(frames)


def share(timing) -> float:
    return timing.encode_ms / (timing.decode_ms + timing.encode_ms)


async def whole(service: DecodeService, z: torch.Tensor, quality: str, output: str) -> tuple[float, DecodeResult]:
    start = time.perf_counter()
    result = await service.decode(DecodeRequest(z, quality, output=output))
    return time.perf_counter() - start, result


async def streamed(service: DecodeService, z: torch.Tensor, quality: str) -> tuple[float, float, bytes, DecodeResult]:
    """(s to the first fragment's bytes, s to the end of the stream, the bytes, the final result)."""
    start = time.perf_counter()
    stream = await service.submit(lambda: DecodeRequest(z, quality, output="mp4", stream=True), z.nbytes)
    first, parts, result = None, [], None
    async for event in stream.events():
        if isinstance(event, Mp4Fragment):
            if first is None:
                first = time.perf_counter() - start
            parts.append(event.data)
        else:
            result = event
    return first, time.perf_counter() - start, b"".join(parts), result


async def measure(service: DecodeService, z: torch.Tensor, quality: str, rounds: int) -> dict[str, list[float]]:
    await whole(service, z, quality, "mp4")  # warm-up: the decoder's first call and the encoder's start
    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        uint8_s, _ = await whole(service, z, quality, "uint8")
        mp4_s, answer = await whole(service, z, quality, "mp4")
        first_s, stream_s, data, end = await streamed(service, z, quality)
        # a stream that drifted from the whole answer would make its timings meaningless
        assert data == answer.output[0], "the streamed fragments differ from the whole mp4 answer"
        for key, value in (
            ("uint8", uint8_s),
            ("mp4", mp4_s),
            ("first", first_s),
            ("stream", stream_s),
            ("share_whole", share(answer.timing)),
            ("share_stream", share(end.timing)),
            ("mib", len(data) / 2**20),
        ):
            runs.setdefault(key, []).append(value)
    return runs


def run_case(case: str, quality: str, rounds: int, threads: int) -> tuple[list, list]:
    model, height, width, frames = parse_case(case)
    config = ServiceConfig(
        model=model, device="cpu", cpu_threads=threads, serving={"fit_prices_at_start": False}
    )  # the fit would compete with the first rounds for the CPUs
    service = DecodeService(config)
    scale = service.engine.spec.spatial_scale
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, service.engine.spec.latent_channels, frames, height // scale, width // scale, generator=g)
    runs = asyncio.run(measure(service, z, quality, rounds))
    service.encoders.shutdown()
    med = {key: statistics.median(values) for key, values in runs.items()}
    size = f"{height}x{width} x {service.engine.spec.output_frames(frames)} frames"
    times = [model, size, med["first"], med["mp4"], med["first"] / med["mp4"], med["stream"],
             med["stream"] / med["mp4"], med["uint8"], med["mp4"] / med["uint8"]]  # fmt: skip
    shares = [model, size, med["share_whole"], med["share_stream"], med["mib"], f"yes ({rounds} of {rounds})"]
    return times, shares


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["tiny-wan:128x224:5", "wan2.1:64x96:3"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quality", default="high")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, cpu, {args.threads} torch threads, {os.cpu_count()} cores, `{args.quality}`")
    times, shares = [], []
    for case in args.cases:
        start = time.perf_counter()
        row_times, row_shares = run_case(case, args.quality, args.rounds, args.threads)
        times.append(row_times)
        shares.append(row_shares)
        print(f"  done {case} in {time.perf_counter() - start:.0f} s", flush=True)
    print_table(
        f"streamed vs whole mp4, batch 1 (median s of {args.rounds} rounds)",
        ["model", "size", "first fragment s (a)", "whole mp4 s (b)", "a / b", "stream end s", "stream / whole",
         "whole uint8 s", "mp4 / uint8"],
        times,
    )  # fmt: skip
    print_table(
        "the encoder's share: encode_ms / (decode_ms + encode_ms) (median)",
        ["model", "size", "whole answer", "stream", "mp4 MiB", "stream bytes == whole bytes"],
        shares,
    )


if __name__ == "__main__":
    main()
