"""Decode sessions (engine/execution/session.py) against the whole decode, engine-level (no Ray), in one
process, measured side by side (rounds rotate the order of the calls, so machine noise and a decode's
spinning threads hit every column alike; medians are printed):

1. time to the first frame: a session's open + its first chunk of 3 latent frames (the chunks
   Self-Forcing/CausVid send) vs the whole decode of the same clip (prepare + decode: a whole answer
   gives its first frame only when it returns) vs the first chunk of a streamed whole decode
   (`stream=True` with a sink: the first latent frame's one frame);
2. each chunk's time, and all chunks' together (the open included) vs the whole decode (goal: within 5%);
3. the history a session holds between chunks: priced at open (`held_price`) vs measured
   (`held_bytes`) after every chunk, and that it does not grow with the clip;
5. (after 4) a long session: 2,000 latent frames in chunks of 4 at a small size, the process's
   resident memory (RSS) and the session's held bytes after chunk 10 and after the last chunk;
4. N sessions at once (N = 1, 4, 8): each chunk step's chunks of all N passed together to
   `decode_session_chunks` (`high` stacks them in one decoder call per latent frame, `lossless`
   decodes each alone) vs the same chunks one session at a time: frames per second and the ratio.

Checked on the way (printed): a session's frames joined against the whole answer, batched sessions'
frames against the same sessions decoded one at a time, and every batched session holding what a
session alone holds (its history copied out of the batch's).
Presets use seeded random weights (they decode noise); speed does not depend on the weights.
Usage: python bench/bench_sessions.py [--quick] [--model wan2.1 --height 16 --width 16 --frames 9]
       [--qualities lossless high] [--rounds 3] [--sessions 1 4 8] [--session-frames 6] [--long-frames 2000]
       (--height/--width are the latents': the frames are 8x larger)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.execution.session import ChunkFrames, DecodeSession
from vae_service.engine.request.session import SessionOpen

MIB = 2**20


def spans(frames: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, frames)) for a in range(0, frames, chunk)]


def clip(engine: DecodeEngine, frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    shape = (1, engine.spec.latent_channels, frames, height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def joined(pixels: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pixels, 1 if pixels[0].dtype == torch.uint8 else 2)


def send(engine: DecodeEngine, sessions: list[DecodeSession], chunks: list[torch.Tensor]) -> list[ChunkFrames]:
    """One chunk per session, checked and decoded in one decode_session_chunks call."""
    checked = [engine.check_chunk(s, DecodeRequest(z), engine.context()) for s, z in zip(sessions, chunks, strict=True)]
    answers = engine.decode_session_chunks(checked)
    for session, answer in zip(sessions, answers, strict=True):
        if not isinstance(answer, ChunkFrames):
            raise answer
        session.advance(answer.step)  # the answer is ready: the session takes the chunk (as the replica does)
    return answers


# ---- 1-3: one session vs the whole decode -----------------------------------------------------
def whole(engine: DecodeEngine, z: torch.Tensor, quality: str) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    (result,) = engine.decode([engine.prepare(DecodeRequest(z, quality=quality))])
    return time.perf_counter() - start, result.output


def streamed(engine: DecodeEngine, z: torch.Tensor, quality: str) -> tuple[float, float]:
    """(s to the first chunk handed to the sink, s to the end of the stream)."""
    first: list[float] = []
    start = time.perf_counter()

    def sink(chunk) -> None:
        if not first:
            first.append(time.perf_counter() - start)

    prepared = engine.prepare(DecodeRequest(z, quality=quality, stream=True))
    (result,) = engine.decode([replace(prepared, sink=sink)])
    if isinstance(result, Exception):
        raise result
    return first[0], time.perf_counter() - start


def session(engine: DecodeEngine, z: torch.Tensor, quality: str, chunk: int) -> dict:
    """The clip sent chunk by chunk in one session: open s, each chunk's s (check + decode, frames on
    the host), held bytes after each chunk, the frames joined."""
    start = time.perf_counter()
    s = engine.open_session("bench", SessionOpen(z.shape[-2], z.shape[-1], quality=quality))
    opened = time.perf_counter() - start
    times, held, pixels = [], [], []
    for a, b in spans(z.shape[2], chunk):
        start = time.perf_counter()
        (answer,) = send(engine, [s], [z[:, :, a:b]])
        times.append(time.perf_counter() - start)
        held.append(s.held_bytes)
        pixels.append(answer.pixels)
    return {"open": opened, "chunks": times, "held": held, "price": s.held_price, "pixels": joined(pixels)}


def one_session_vs_whole(engine: DecodeEngine, args, quality: str, runs: dict) -> None:
    """One round of the three decodes of the clip at `quality`, in `runs[quality]["order"]` (rotated)."""
    z = clip(engine, args.frames, args.height, args.width, seed=0)
    r = runs[quality]
    for name in r["order"]:
        if name == "whole":
            seconds, r["whole_pixels"] = whole(engine, z, quality)
            r["whole"].append(seconds)
        elif name == "streamed":
            first, end = streamed(engine, z, quality)
            r["stream_first"].append(first)
            r["stream_end"].append(end)
        else:
            r["sessions"].append(session(engine, z, quality, args.chunk))
    r["order"] = r["order"][1:] + r["order"][:1]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    if all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
        return "bit-identical"
    return f"max |diff| {max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True)):.2g}"


def tables_1_to_3(engine: DecodeEngine, args, size: str, runs: dict) -> None:
    first_rows, chunk_rows, held_rows = [], [], []
    k = len(spans(args.frames, args.chunk))
    first_chunk_frames = engine.spec.output_frames(min(args.chunk, args.frames))
    for quality, r in runs.items():
        sessions = r["sessions"]
        med = statistics.median
        whole_s = med(r["whole"])
        first_s = med([s["open"] + s["chunks"][0] for s in sessions])
        total_s = med([s["open"] + sum(s["chunks"]) for s in sessions])
        per_chunk = [med([s["chunks"][i] for s in sessions]) for i in range(k)]
        first_rows.append([quality, first_s, whole_s, first_s / whole_s, med(r["stream_first"]),
                           med(r["stream_first"]) / whole_s, med(r["stream_end"])])  # fmt: skip
        ratio = total_s / whole_s
        chunk_rows.append([quality, med([s["open"] for s in sessions]) * 1e3, " / ".join(f"{t:.3g}" for t in per_chunk),
                           total_s, whole_s, ratio, "yes" if ratio <= 1.05 else "NO",
                           same([sessions[-1]["pixels"]], [r["whole_pixels"]])])  # fmt: skip
        held = sessions[-1]["held"]
        grows = "no" if all(h == held[0] for h in held) else "YES: " + " / ".join(f"{h / MIB:.4g}" for h in held)
        held_rows.append([quality, sessions[-1]["price"] / MIB, held[0] / MIB, held[-1] / MIB,
                          held[-1] / sessions[-1]["price"], grows])  # fmt: skip
    n = len(runs[next(iter(runs))]["whole"])
    print_table(
        f"1. time to the first frame, {size} (median s of {n} rounds): a session's open + first chunk "
        f"({min(args.chunk, args.frames)} latent frames = {first_chunk_frames} frames) vs the whole decode",
        ["quality", "session: first chunk s (a)", "whole decode s (b)", "a / b",
         "streamed whole: first chunk s (1 frame)", "streamed first / b", "streamed whole: end s"],
        first_rows,
    )  # fmt: skip
    print_table(
        f"2. a session's chunks of {args.chunk} latent frames ({k} chunks) vs the whole decode (median s)",
        ["quality", "open ms", "each chunk s", "open + all chunks s (a)", "whole decode s (b)", "a / b",
         "within 5%", "frames joined vs whole"],
        chunk_rows,
    )  # fmt: skip
    print_table(
        f"3. history held between chunks (MiB): priced at open vs measured after chunk 1 and chunk {k}",
        ["quality", "held_price", "held_bytes after 1", f"held_bytes after {k}", "measured / priced",
         f"grows over {k} chunks"],
        held_rows,
    )  # fmt: skip


# ---- 5: a long session holds what a short one holds ------------------------------------------
def rss_bytes() -> int:
    """This process's resident memory now (not its peak): /proc/self/statm's second field."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def long_session(engine: DecodeEngine, args) -> None:
    h, w, chunk, total = 4, 6, 4, args.long_frames
    s = engine.open_session("long", SessionOpen(h, w, output="uint8"))
    marks, start = {}, time.perf_counter()
    for i, (a, b) in enumerate(spans(total, chunk)):
        send(engine, [s], [clip(engine, b - a, h, w, seed=i)])
        if i + 1 in (10, 100) or b == total:
            marks[i + 1] = (rss_bytes(), s.held_bytes, s.frames)
    seconds = time.perf_counter() - start
    tenth = marks[10]
    rows = [[k, frames, rss / MIB, (rss - tenth[0]) / MIB, held / MIB, held == tenth[1]]
            for k, (rss, held, frames) in marks.items()]  # fmt: skip
    print_table(
        f"5. one session of {total} latent frames ({h}x{w} latents, chunks of {chunk}, {seconds:.0f} s): "
        "resident memory and held bytes after chunk k",
        ["chunk k", "frames so far", "RSS MiB", "RSS - RSS after chunk 10, MiB", "held_bytes MiB",
         "held equal to after chunk 10"],
        rows,
    )  # fmt: skip


# ---- 4: N sessions at once vs one at a time ---------------------------------------------------
def batched(engine: DecodeEngine, zs: list[torch.Tensor], quality: str, chunk: int) -> tuple[float, list, list]:
    """All sessions opened, then each chunk step's chunks of all of them in one call."""
    start = time.perf_counter()
    sessions = [engine.open_session(f"s{i}", SessionOpen(*zs[0].shape[-2:], quality=quality)) for i in range(len(zs))]
    pixels: list[list[torch.Tensor]] = [[] for _ in zs]
    for a, b in spans(zs[0].shape[2], chunk):
        for i, answer in enumerate(send(engine, sessions, [z[:, :, a:b] for z in zs])):
            assert answer.batch_size == len(zs)
            pixels[i].append(answer.pixels)
    return time.perf_counter() - start, [joined(p) for p in pixels], [s.held_bytes for s in sessions]


def one_at_a_time(engine: DecodeEngine, zs: list[torch.Tensor], quality: str, chunk: int) -> tuple[float, list, list]:
    start = time.perf_counter()
    out, held = [], []
    for i, z in enumerate(zs):
        s = engine.open_session(f"s{i}", SessionOpen(*z.shape[-2:], quality=quality))
        out.append(joined([send(engine, [s], [z[:, :, a:b]])[0].pixels for a, b in spans(z.shape[2], chunk)]))
        held.append(s.held_bytes)
    return time.perf_counter() - start, out, held


def concurrent(engine: DecodeEngine, args, size: str) -> None:
    frames = engine.spec.output_frames(args.session_frames)
    clips = [
        clip(engine, args.session_frames, args.height, args.width, seed=100 + i) for i in range(max(args.sessions))
    ]
    for quality in args.qualities:  # warm-up: two sessions stacked, every chunk step
        batched(engine, clips[:2], quality, args.chunk)
    times = {(q, n, mode): [] for q in args.qualities for n in args.sessions for mode in ("batched", "alone")}
    checks: dict[tuple, list[str]] = {}
    turn = 0
    for _ in range(args.concurrent_rounds):
        for quality in args.qualities:
            for n in args.sessions:
                order, turn = ("batched", "alone")[:: 1 if turn % 2 == 0 else -1], turn + 1
                got = {}
                for mode in order:
                    run = batched if mode == "batched" else one_at_a_time
                    seconds, got[mode], held = run(engine, clips[:n], quality, args.chunk)
                    times[quality, n, mode].append(seconds)
                    got[mode + " held"] = held
                held_same = "yes" if got["batched held"] == got["alone held"] else "NO"
                checks[quality, n] = [same(got["batched"], got["alone"]), held_same]
                print(f"  done {quality} N={n}", flush=True)
    rows = []
    for quality in args.qualities:
        for n in args.sessions:
            b = statistics.median(times[quality, n, "batched"])
            a = statistics.median(times[quality, n, "alone"])
            rows.append([quality, n, n * frames / b, n * frames / a, a / b, *checks[quality, n]])
    print_table(
        f"4. N sessions at once, {size.split(' x ')[0]} x {frames} frames each ({args.session_frames} latent "
        f"frames in chunks of {args.chunk}; median of {args.concurrent_rounds}): each chunk step of all N in one "
        "decode_session_chunks call vs one session at a time (open included)",
        ["quality", "N", "batched frames/s", "one at a time frames/s", "batched / one at a time",
         "batched frames vs one at a time", "held bytes per session equal"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-wan")
    parser.add_argument("--height", type=int, help="latent height (default 12; --quick 8)")
    parser.add_argument("--width", type=int, help="latent width (default 20; --quick 14)")
    parser.add_argument("--frames", type=int, default=9, help="latent frames of the clip of tables 1-3")
    parser.add_argument("--chunk", type=int, default=3, help="latent frames per session chunk")
    parser.add_argument("--qualities", nargs="+", default=["lossless", "high"], choices=["lossless", "high"])
    parser.add_argument("--rounds", type=int, help="rounds of tables 1-3 (default 3; --quick 1)")
    parser.add_argument("--sessions", nargs="*", type=int, help="N of table 4 (default 1 4 8; --quick 1 4; none: skip)")
    parser.add_argument("--session-frames", type=int, default=6, help="latent frames per session in table 4")
    parser.add_argument("--concurrent-rounds", type=int, default=1, help="rounds of table 4")
    parser.add_argument("--long-frames", type=int, help="latent frames of table 5 (default 2000; --quick 200; 0: skip)")
    parser.add_argument("--quick", action="store_true", help="8x14 latents, 1 round, N = 1 and 4")
    args = parser.parse_args()
    quick = args.quick
    args.height = args.height or (8 if quick else 12)
    args.width = args.width or (14 if quick else 20)
    args.rounds = args.rounds or (1 if quick else 3)
    if args.sessions is None:
        args.sessions = [1, 4] if quick else [1, 4, 8]
    if args.long_frames is None:
        args.long_frames = 200 if quick else 2000
    began = time.perf_counter()
    engine = DecodeEngine(ServiceConfig(model=args.model, decode_precision="fp32"))
    if why := engine.sessions_unsupported_because():
        sys.exit(why)
    scale = engine.spec.spatial_scale
    size = f"{args.height * scale}x{args.width * scale} px x {engine.spec.output_frames(args.frames)} frames"
    print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores, fp32")
    print(f"model {args.model}: latents {args.height}x{args.width} x {args.frames} latent frames = {size}")
    if engine.spec.random_weights:
        print(f"*** {args.model}: SEEDED RANDOM WEIGHTS, IT DECODES NOISE (speed does not depend on the weights) ***")
    for quality in args.qualities:  # warm-up: the first chunk's shape through every path
        z = clip(engine, min(args.chunk, args.frames), args.height, args.width, seed=1)
        whole(engine, z, quality)
        session(engine, z, quality, args.chunk)
    order = ["whole", "streamed", "session"]
    runs = {q: {"order": order[i % 3 :] + order[: i % 3], "whole": [], "stream_first": [], "stream_end": [],
                "sessions": []} for i, q in enumerate(args.qualities)}  # fmt: skip
    for i in range(args.rounds):
        for quality in args.qualities:
            one_session_vs_whole(engine, args, quality, runs)
        print(f"  done round {i + 1} of {args.rounds}", flush=True)
    tables_1_to_3(engine, args, size, runs)
    if args.sessions:
        concurrent(engine, args, size)
    if args.long_frames:
        long_session(engine, args)
    print(f"\ndone in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
