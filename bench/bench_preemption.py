"""A live session's chunk latency beside bulk work on the same replica, with the scheduler's
preemption on, off, and on with no room for suspended work (`scheduling.suspended_bytes` 1: new work
waits instead of preempting), and the bulk work's throughput beside the session vs alone. One
replica's service core in process (DecodeService: the scheduler, the engine, the session registry;
no HTTP hop), a preset with SEEDED RANDOM WEIGHTS (it decodes noise; the timings do not depend on
the weights): tiny-wan on this CPU (cpu_threads 1) by default, wan2.1 on a GPU (the GPU list).

The session sends a chunk of one latent frame every CHUNK_EVERY_S (a 16 fps stream: 4 frames per
latent frame) and waits for each answer. Bulk work, one kind per row, kept going for the whole run:
- video: whole-clip /decodes of `--video-latent-frames` latent frames, one after another (a step:
  one latent frame);
- tiled image: `lossless` images of `--tiled-side` px by the class's own tiled decode (`tiling: model`),
  one after another (a step: one tile);
- batch items: a batch-decode job's items sent to the replica as `bulk` requests, BATCH_IN_FLIGHT
  at a time (short clips; a step: one latent frame of a batch).

Printed per row: chunk p50/p99 alone and beside the bulk work (preemption on / off / no room), one
bulk step (the longest of a round alone, as the scheduler saw it), whether p99 beside is within p99
alone + one step, the bulk work per second alone and beside the session, and that rate over what
the device time the session leaves allows (1.0: work-conserving).

Usage: python bench/bench_preemption.py [--quick] [--seconds S] [--model M --device D --precision P
       --latent-hw H W --video-latent-frames T --tiled-side PX]
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
from vae_service.engine.request.session import SessionOpen
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.scheduling.wait_stats import ClassStats

CHUNK_EVERY_S = 0.25
BATCH_IN_FLIGHT, BATCH_LATENT_FRAMES = 4, 3


class Setup:
    """What a run decodes: the model and device, the session's latent size, the bulk work's sizes."""

    def __init__(self, args: argparse.Namespace):
        self.model, self.device, self.precision = args.model, args.device, args.precision
        self.h, self.w = args.latent_hw
        self.video_latent_frames, self.tiled_side = args.video_latent_frames, args.tiled_side

    def service(self, **scheduling) -> DecodeService:
        config = ServiceConfig(
            model=self.model,
            device=self.device,
            decode_precision=self.precision,
            cpu_threads=1 if self.device == "cpu" else None,
            scheduling=scheduling,
            batching={"request_timeout_s": 600},
        )
        return DecodeService(config)


def latents(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bulk_requests(setup: Setup, kind: str, channels: int) -> tuple[list[DecodeRequest], int]:
    """The requests one round of `kind` sends at once, and the items it counts."""
    h, w = setup.h, setup.w
    if kind == "video":
        return [DecodeRequest(latents(1, channels, setup.video_latent_frames, h, w), priority="bulk")], 1
    if kind == "tiled image":
        side = setup.tiled_side // 8
        return [DecodeRequest(latents(1, channels, 1, side, side), tiling="model", priority="bulk")], 1
    clips = [
        DecodeRequest(latents(1, channels, BATCH_LATENT_FRAMES, h, w, seed=s), priority="bulk")
        for s in range(BATCH_IN_FLIGHT)
    ]
    return clips, BATCH_IN_FLIGHT


async def keep_bulk_going(setup: Setup, svc: DecodeService, kind: str, until: float) -> int:
    """Bulk rounds until `until` (the last one runs to its end); the items answered."""
    done = 0
    while time.perf_counter() < until:
        requests, items = bulk_requests(setup, kind, svc.engine.spec.latent_channels)
        await asyncio.gather(*(svc.decode(r) for r in requests))
        done += items
    return done


async def session_chunks(setup: Setup, svc: DecodeService, until: float) -> tuple[list[float], float]:
    """Chunk latencies (ms) of one session until `until`, and the device ms its chunks took."""
    opening = SessionOpen(setup.h, setup.w)
    session = svc.sessions.open(opening)
    z = latents(1, svc.engine.spec.latent_channels, 64, setup.h, setup.w, seed=7)
    times, device_ms, t = [], 0.0, 0
    try:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            if t == z.shape[2]:  # a clip's end: the next one in a new session
                svc.sessions.close(session.id)
                session, t = svc.sessions.open(opening), 0
            answer = await svc.sessions.chunk(session.id, DecodeRequest(z[:, :, t : t + 1]))
            times.append((time.perf_counter() - sent) * 1e3)
            device_ms += answer.frames.decode_ms
            t += 1
            await asyncio.sleep(max(0.0, CHUNK_EVERY_S - (time.perf_counter() - sent)))
    finally:
        svc.sessions.close(session.id)
    return times, device_ms


async def run(setup: Setup, svc: DecodeService, seconds: float, kind: str | None, session: bool) -> dict:
    until = time.perf_counter() + seconds
    work = []
    if session:
        work.append(session_chunks(setup, svc, until))
    if kind is not None:
        work.append(keep_bulk_going(setup, svc, kind, until))
    start = time.perf_counter()
    results = await asyncio.gather(*work)
    out = {"elapsed": time.perf_counter() - start}
    if session:
        out["chunks"], out["session_device_ms"] = results[0]
    if kind is not None:
        out["bulk_items"] = results[-1]
    return out


async def longest_bulk_step_ms(setup: Setup, svc: DecodeService, kind: str) -> float:
    """The longest step of one bulk round alone (the scheduler's own figure): what a chunk may
    wait for at most beside it."""
    svc.scheduler.stats = ClassStats()
    requests, _ = bulk_requests(setup, kind, svc.engine.spec.latent_channels)
    await asyncio.gather(*(svc.decode(r) for r in requests))
    return svc.scheduler.stats.classes["bulk"].longest_step_s * 1e3


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def p50_p99(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} / {p(values, 0.99):.0f}"


async def main_async(setup: Setup, seconds: float, kinds: list[str]) -> None:
    services = {
        "on": setup.service(),
        "off": setup.service(preemption=False),
        "no room": setup.service(suspended_bytes=1),
    }
    for svc in services.values():  # weights touched, walks and prices warmed
        await run(setup, svc, 1.0, None, session=True)
        await longest_bulk_step_ms(setup, svc, "video")
    on = services["on"]
    alone = await run(setup, on, seconds, None, session=True)
    alone_p99 = p(alone["chunks"], 0.99)
    session_share = alone["session_device_ms"] / 1e3 / alone["elapsed"]
    rows = []
    for kind in kinds:
        step = await longest_bulk_step_ms(setup, on, kind)
        bulk_alone = await run(setup, on, seconds, kind, session=False)
        rate_alone = bulk_alone["bulk_items"] / bulk_alone["elapsed"]
        beside = {name: await run(setup, svc, seconds, kind, session=True) for name, svc in services.items()}
        on_chunks = beside["on"]["chunks"]
        rate_beside = beside["on"]["bulk_items"] / beside["on"]["elapsed"]
        rows.append(
            [
                kind,
                p50_p99(alone["chunks"]),
                p50_p99(on_chunks),
                p50_p99(beside["off"]["chunks"]),
                p50_p99(beside["no room"]["chunks"]),
                f"{step:.0f}",
                "yes" if p(on_chunks, 0.99) <= alone_p99 + step else "no",
                f"{rate_alone:.3g}",
                f"{rate_beside:.3g}",
                f"{rate_beside / (rate_alone * (1 - session_share)):.2f}",
            ]
        )
    print_table(
        f"session chunk latency beside bulk work, {setup.model} on {setup.device}, {seconds:g} s per run "
        "(ms, p50 / p99; bulk in items/s)",
        [
            "bulk work",
            "chunk alone",
            "beside: preemption on",
            "off",
            "on, no room",
            "longest bulk step",
            "p99 <= alone p99 + step",
            "bulk alone",
            "bulk beside (on)",
            "of what is left",
        ],
        rows,
    )
    print(f"session device share alone: {session_share:.1%} ({len(alone['chunks'])} chunks)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="short runs of the video row: a smoke run")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--model", default="tiny-wan")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    parser.add_argument("--latent-hw", type=int, nargs=2, default=[8, 8], metavar=("H", "W"))
    parser.add_argument("--video-latent-frames", type=int, default=20)
    parser.add_argument("--tiled-side", type=int, default=1024, help="px (2048: ~33 s an image with tiny-wan here)")
    parser.add_argument("--kinds", nargs="+", default=["video", "tiled image", "batch items"])
    args = parser.parse_args()
    kinds = ["video"] if args.quick else args.kinds
    asyncio.run(main_async(Setup(args), 3.0 if args.quick else args.seconds, kinds))


if __name__ == "__main__":
    main()
