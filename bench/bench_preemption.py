"""A live session's chunk latency beside bulk work on the same replica, with the scheduler's
preemption on and off (serving/scheduling/scheduler.py), and the bulk work's throughput beside the
session vs alone. One replica's service core in process (DecodeService: the scheduler, the engine,
the session registry; no HTTP hop), tiny-wan preset with SEEDED RANDOM WEIGHTS (it decodes noise;
the timings do not depend on the weights), cpu_threads 1.

The session sends a chunk of one latent frame every CHUNK_EVERY_S (a 16 fps stream: 4 frames per
latent frame) and waits for each answer. Bulk work, one kind per row, kept going for the whole run:
- video: whole-clip /decodes of VIDEO_LATENT_FRAMES latent frames, one after another (a step: one
  latent frame);
- tiled image: `lossless` images of TILED_SIDE px by the class's own tiled decode (`tiling: model`),
  one after another (a step: one tile);
- batch items: a batch-decode job's items sent to the replica as `bulk` requests, BATCH_IN_FLIGHT
  at a time (short clips; a step: one latent frame of a batch).

Printed per row: chunk p50/p99 alone and beside the bulk work (preemption on / off), one bulk step
(its decode alone over its steps), whether p99 beside is within p99 alone + one step, the bulk work
per second alone and beside the session, and that rate over what the device time the session
leaves allows (1.0: work-conserving).

Usage: python bench/bench_preemption.py [--quick] [--seconds S]
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

CHUNK_EVERY_S = 0.25
H = W = 8  # the session's latents (64 px frames)
VIDEO_LATENT_FRAMES = 20
TILED_SIDE = 1024  # px; 2048 takes ~33 s a image on this 2-core CPU with tiny-wan
BATCH_IN_FLIGHT, BATCH_LATENT_FRAMES = 4, 3


def service(preemption: bool) -> DecodeService:
    config = ServiceConfig(
        model="tiny-wan",
        device="cpu",
        cpu_threads=1,
        scheduling={"preemption": preemption},
        batching={"request_timeout_s": 600},
    )
    return DecodeService(config)


def latents(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bulk_requests(kind: str, channels: int) -> tuple[list[DecodeRequest], int]:
    """The requests one round of `kind` sends at once, and the latent frames (or tiles) it counts."""
    if kind == "video":
        return [DecodeRequest(latents(1, channels, VIDEO_LATENT_FRAMES, H, W), priority="bulk")], 1
    if kind == "tiled image":
        side = TILED_SIDE // 8
        return [DecodeRequest(latents(1, channels, 1, side, side), tiling="model", priority="bulk")], 1
    clips = [
        DecodeRequest(latents(1, channels, BATCH_LATENT_FRAMES, H, W, seed=s), priority="bulk")
        for s in range(BATCH_IN_FLIGHT)
    ]
    return clips, BATCH_IN_FLIGHT


async def keep_bulk_going(svc: DecodeService, kind: str, until: float) -> int:
    """Bulk rounds until `until` (the last one runs to its end); the items answered."""
    done = 0
    while time.perf_counter() < until:
        requests, items = bulk_requests(kind, svc.engine.spec.latent_channels)
        await asyncio.gather(*(svc.decode(r) for r in requests))
        done += items
    return done


async def session_chunks(svc: DecodeService, until: float) -> tuple[list[float], float]:
    """Chunk latencies (ms) of one session until `until`, and the device ms its chunks took."""
    session = svc.sessions.open(SessionOpen(H, W))
    z = latents(1, svc.engine.spec.latent_channels, 64, H, W, seed=7)
    times, device_ms, t = [], 0.0, 0
    try:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            if t == z.shape[2]:
                svc.sessions.close(session.id)
                session, t = svc.sessions.open(SessionOpen(H, W)), 0
            answer = await svc.sessions.chunk(session.id, DecodeRequest(z[:, :, t : t + 1]))
            times.append((time.perf_counter() - sent) * 1e3)
            device_ms += answer.frames.decode_ms
            t += 1
            await asyncio.sleep(max(0.0, CHUNK_EVERY_S - (time.perf_counter() - sent)))
    finally:
        svc.sessions.close(session.id)
    return times, device_ms


async def run(svc: DecodeService, seconds: float, kind: str | None, session: bool) -> dict:
    until = time.perf_counter() + seconds
    work = []
    if session:
        work.append(session_chunks(svc, until))
    if kind is not None:
        work.append(keep_bulk_going(svc, kind, until))
    start = time.perf_counter()
    results = await asyncio.gather(*work)
    elapsed = time.perf_counter() - start
    out = {"elapsed": elapsed}
    if session:
        out["chunks"], out["session_device_ms"] = results[0]
    if kind is not None:
        out["bulk_items"] = results[-1]
    return out


async def bulk_step_ms(svc: DecodeService, kind: str) -> float:
    """One bulk round alone, over the steps it ran (the scheduler's count)."""
    requests, _ = bulk_requests(kind, svc.engine.spec.latent_channels)
    before = svc.scheduler.stats.classes["bulk"].steps
    start = time.perf_counter()
    await asyncio.gather(*(svc.decode(r) for r in requests))
    took = (time.perf_counter() - start) * 1e3
    return took / max(1, svc.scheduler.stats.classes["bulk"].steps - before)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main_async(seconds: float, kinds: list[str]) -> None:
    on, off = service(True), service(False)
    for svc in (on, off):  # weights touched, walks and prices warmed
        await run(svc, 1.0, None, session=True)
        await bulk_step_ms(svc, "video")
    alone = await run(on, seconds, None, session=True)
    alone_p50, alone_p99 = statistics.median(alone["chunks"]), p(alone["chunks"], 0.99)
    session_share = alone["session_device_ms"] / 1e3 / alone["elapsed"]
    rows = []
    for kind in kinds:
        step = await bulk_step_ms(on, kind)
        bulk_alone = await run(on, seconds, kind, session=False)
        rate_alone = bulk_alone["bulk_items"] / bulk_alone["elapsed"]
        beside = {}
        for name, svc in (("on", on), ("off", off)):
            beside[name] = await run(svc, seconds, kind, session=True)
        on_chunks, off_chunks = beside["on"]["chunks"], beside["off"]["chunks"]
        rate_beside = beside["on"]["bulk_items"] / beside["on"]["elapsed"]
        rows.append(
            [
                kind,
                f"{alone_p50:.0f} / {alone_p99:.0f}",
                f"{statistics.median(on_chunks):.0f} / {p(on_chunks, 0.99):.0f}",
                f"{statistics.median(off_chunks):.0f} / {p(off_chunks, 0.99):.0f}",
                f"{step:.0f}",
                "yes" if p(on_chunks, 0.99) <= alone_p99 + step else "no",
                f"{rate_alone:.3g}",
                f"{rate_beside:.3g}",
                f"{rate_beside / (rate_alone * (1 - session_share)):.2f}",
            ]
        )
    print_table(
        f"session chunk latency beside bulk work, tiny-wan, {seconds:g} s per run (ms; bulk in items/s)",
        [
            "bulk work",
            "chunk p50/p99 alone",
            "beside, preemption on",
            "beside, off",
            "bulk step",
            "p99 <= alone+step",
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
    args = parser.parse_args()
    kinds = ["video"] if args.quick else ["video", "tiled image", "batch items"]
    asyncio.run(main_async(3.0 if args.quick else args.seconds, kinds))


if __name__ == "__main__":
    main()
