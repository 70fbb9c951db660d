"""One request across replicas or devices, side by side in one run (answers checked bit for bit):

- Serve (default): one tiled `high` request on one replica vs the same plan shared over N replicas
  of its deployment (engine/execution/tile_executor.py; every replica single-threaded, cpu_threads 1), with
  the request untiled as a baseline. The plan is forced by `limits.max_decode_bytes` (tiles of
  about --tile-px), the same on both sides.
- `--saturation`: C clients sending large `high` requests at once to N replicas, tiles shared
  (tiles_across_replicas on, parallel.min_output_pixels --tile-px^2) vs not (off), in interleaved
  rounds: throughput and median latency, on over off. `--kill`: one more round with sharing on in
  which a replica is killed mid-run (Serve replaces it; clients retry 503): requests lost.
- `--devices` (no Ray; GPU machines): one DecodeEngine per device in this process, the other
  devices taking tiles as replicas do (one at a time each), the request's own device decoding the
  rest. Untiled on the first device, tiled on it alone, tiled over all of them. `--devices all`
  (default there): every visible CUDA device; `--devices cpu,cpu`: two CPU engines of one thread.

Presets use seeded random weights (they decode noise); speed does not depend on the weights.
Targets (issue #30): one request on two single-thread replicas >= 1.7x one; saturation: throughput
on >= 0.95x off, median latency within 5%; a replica killed: no request lost.
Cases: model:size[:latent_frames], size N or HxW, e.g. sd:256, wan2.1:96x96:2, wan2.1:480x832:21.
Usage: python bench/bench_parallel.py [--case sd:256] [--tile-px 128] [--replicas 2] [--repeat 3]
       python bench/bench_parallel.py --saturation [--clients 8] [--requests 2] [--kill]
       python bench/bench_parallel.py --devices [all|cuda:0,cuda:1|cpu,cpu] [--precision bf16]
           [--cases wan2.1:480x832:21 wan2.1:720x1280:21 sd:2048] [--tile-px N] [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table

from vae_service.engine.planning.tiling import MIN_TILE, TileGrid

# Serve mode builds latents without loading the model here: presets with 8x spatial latents
LATENT_CHANNELS = {"sd": 4, "sdxl": 4, "flux": 16, "tiny-kl": 4, "wan2.1": 16, "tiny-wan": 4, "qwen-image": 16}
SCALE = 8
GPU_CASES = ["wan2.1:480x832:21", "wan2.1:720x1280:21", "sd:2048"]


def parse_case(case: str) -> tuple[str, int, int, int | None]:
    """model:size[:latent_frames] -> (model, height, width, latent frames or None for an image)."""
    model, size, *frames = case.split(":")
    height, width = (int(v) for v in size.split("x")) if "x" in size else (int(size), int(size))
    return model, height, width, int(frames[0]) if frames else None


def latents(channels: int, scale: int, height: int, width: int, frames: int | None, seed: int = 0) -> torch.Tensor:
    video = [] if frames is None else [frames]
    shape = [1, channels, *video, height // scale, width // scale]
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def interleaved(runs: dict[str, Callable[[], object]], repeat: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds and last answer of each run; rounds interleave the runs so machine noise hits
    all alike, the first round warms up."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    answers: dict[str, object] = {}
    for i in range(repeat + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            answers[name] = run()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, answers


def describe_grid(grid: TileGrid | None) -> str:
    if grid is None:
        return "untiled"
    return f"{len(grid.tiles())} tiles of {grid.tile_h * SCALE}x{grid.tile_w * SCALE} px"


# --- Serve mode ------------------------------------------------------------------------------


def deploy(name: str, config: dict, replicas: int) -> str:
    from ray import serve

    from vae_service.serving.app import decoder_app

    config = {"model_name": name, "device": "cpu", "cpu_threads": 1, **config}
    scaling = {"min_replicas": replicas, "max_replicas": replicas, "initial_replicas": replicas}
    # no CPU reservation: Ray counts this machine's cores, and the apps' replicas outnumber them
    options = {"autoscaling_config": scaling, "ray_actor_options": {"num_cpus": 0}}
    serve.run(decoder_app(config, **options), name=name, route_prefix=f"/{name}")
    return name


def forced_bound(model: str, z: torch.Tensor, tile_px: int) -> tuple[int, TileGrid]:
    """The smallest limits.max_decode_bytes under which `z` decodes in `high` tiles of at least
    tile_px (a replica of `model` at cpu_threads 1 plans them alike), and that plan."""
    from vae_service.config import ServiceConfig
    from vae_service.engine import DecodeEngine, DecodeRequest
    from vae_service.engine.planning.planner import tiles_within

    engine = DecodeEngine(ServiceConfig(model=model, device="cpu", cpu_threads=1))
    prepared = engine.check(DecodeRequest(z, quality="high", latents_scaled=True))
    want, lo, hi = tile_px // SCALE, 1, engine.cost.peak(prepared)

    def tiles_of(bound: int) -> TileGrid | None:
        grid = tiles_within(prepared, engine.cost, bound)
        return grid if grid is not None and grid.tile >= want else None

    while lo < hi:  # tiles grow with the bound
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if tiles_of(mid) is not None else (mid + 1, hi)
    return lo, tiles_of(lo)


def one_request(args, base: str) -> bool:
    from vae_service_client import VaeClient

    case = args.case or f"{args.model}:{args.size}"
    model, height, width, frames = parse_case(case)
    if model not in LATENT_CHANNELS or frames is not None:
        raise SystemExit(f"--case: Serve mode takes an image of {sorted(LATENT_CHANNELS)}, not {case!r}")
    z = latents(LATENT_CHANNELS[model], SCALE, height, width, frames)
    bound, grid = forced_bound(model, z, args.tile_px)
    if grid is None or len(grid.tiles()) < 2:
        raise SystemExit(f"--tile-px {args.tile_px}: {case} is one tile; nothing to share")
    tiled = {"model": model, "limits": {"max_decode_bytes": bound}}
    names = {
        "untiled": deploy("untiled", {"model": model}, 1),
        "one": deploy("one", tiled, 1),
        "shared": deploy("shared", tiled, args.replicas),
    }
    with contextlib.ExitStack() as stack:
        clients = {name: stack.enter_context(VaeClient(f"{base}/{app}", timeout=600)) for name, app in names.items()}
        runs = {
            name: lambda c=client: c.decode(z, quality="high", output="uint8", scaling_factor=None)
            for name, client in clients.items()
        }
        seconds, answers = interleaved(runs, args.repeat)
    one, shared, untiled = answers["one"], answers["shared"], answers["untiled"]
    identical = np.array_equal(one.output, shared.output)
    if untiled.tiled or not one.tiled or not shared.tiled:
        print(f"! plans: untiled {untiled.tiled}, one {one.tiled}, shared {shared.tiled} (tiled?)")
    n = args.replicas
    print_table(
        f"{model} {height}x{width} `high`, {describe_grid(grid)}: untiled and tiled on one replica vs the same "
        f"tiles shared over {n} (cpu_threads 1 each, median of {args.repeat})",
        [
            "untiled, 1 replica s",
            "tiled, 1 replica s",
            f"tiled, {n} replicas s",
            "speed-up",
            "vs untiled",
            "over a perfect split s",
            "replicas used",
            "identical",
        ],
        [
            [
                seconds["untiled"],
                seconds["one"],
                seconds["shared"],
                seconds["one"] / seconds["shared"],
                seconds["untiled"] / seconds["shared"],
                seconds["shared"] - seconds["one"] / n,
                shared.timing["replicas"],
                identical,
            ]
        ],
    )
    return identical


def _replicas_of(app: str) -> list[str]:
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]


def load_round(url: str, zs: list[torch.Tensor], requests: int, kill: str | None = None) -> dict:
    """len(zs) clients at once, each sending its latents `requests` times (the client's own retries
    of 429/503): wall seconds, every latency, and the requests lost (an error after the retries).
    `kill`: that Serve app loses one replica once half the requests are answered."""
    import ray

    from vae_service_client import VaeClient

    latencies, lost, done = [], [], threading.Event()
    total = len(zs) * requests

    def client(z):
        with VaeClient(url, timeout=600) as c:
            for _ in range(requests):
                start = time.perf_counter()
                try:
                    c.decode(z, quality="high", output="uint8", scaling_factor=None)
                    latencies.append(time.perf_counter() - start)
                except Exception as error:
                    lost.append(f"{type(error).__name__}: {error}")
                if len(latencies) + len(lost) >= total // 2:
                    done.set()

    threads = [threading.Thread(target=client, args=(z,)) for z in zs]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    if kill is not None:
        done.wait()
        victim = _replicas_of(kill)[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        print(f"  killed {victim} after {len(latencies) + len(lost)} of {total} requests", flush=True)
    for thread in threads:
        thread.join()
    return {"wall": time.perf_counter() - start, "latencies": latencies, "lost": lost, "total": total}


def saturation(args, base: str) -> bool:
    case = args.case or f"{args.model}:{args.size}"
    model, height, width, frames = parse_case(case)
    zs = [latents(LATENT_CHANNELS[model], SCALE, height, width, frames, seed=i) for i in range(args.clients)]
    shared = {"tiles_across_replicas": True, "min_output_pixels": args.tile_px**2}
    names = {
        "on": deploy("on", {"model": model, "parallel": shared}, args.replicas),
        "off": deploy("off", {"model": model, "parallel": {"tiles_across_replicas": False}}, args.replicas),
    }
    load_round(f"{base}/on", zs[:2], 1)  # warm-up: first decodes and the folded weights, both apps
    load_round(f"{base}/off", zs[:2], 1)
    rounds: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeat):
        for name, app in names.items():
            rounds[name].append(load_round(f"{base}/{app}", zs, args.requests))
    rows = []
    for name, done in rounds.items():
        wall = sum(r["wall"] for r in done)
        answered = sum(len(r["latencies"]) for r in done)
        latencies = [t for r in done for t in r["latencies"]]
        rows.append([name, answered / wall, statistics.median(latencies), sum(len(r["lost"]) for r in done)])
    (on, off) = rows
    print_table(
        f"{model} {height}x{width} `high`, {args.clients} clients x {args.requests} requests on {args.replicas} "
        f"replicas, tiles of about {args.tile_px} px shared while a replica is idle (on) or not (off); "
        f"{args.repeat} rounds each, interleaved",
        ["sharing", "requests/s", "median latency s", "lost"],
        rows,
    )
    print(f"throughput on/off {on[1] / off[1]:.3f} (target >= 0.95); median latency on/off {on[2] / off[2]:.3f}")
    ok = on[3] == off[3] == 0
    if args.kill:
        killed = load_round(f"{base}/on", zs, args.requests, kill="on")
        print(
            f"one replica killed mid-run, sharing on: {len(killed['latencies'])} of {killed['total']} answered, "
            f"{len(killed['lost'])} lost {killed['lost'][:2]}"
        )
        ok = ok and not killed["lost"]
    return ok


def serve_mode(args) -> int:
    with local_serve() as base:
        ok = saturation(args, base) if args.saturation else one_request(args, base)
    return 0 if ok else 1


# --- --devices mode: engines in this process, no Ray -------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DevicePeers:
    """The engine's TilePeers over engines of one model on the other devices of this process: each
    takes one tile at a time (as a replica does) and decodes it on a thread bound to it; tiles no
    device is free for are refused (decoded by the request's own). `busy`: the seconds each spent
    in its tiles' decodes (synchronized) since `reset`."""

    retry_after_s = 1.0

    def __init__(self, engines: list):
        self.engines = engines
        self.slots = [threading.Lock() for _ in engines]
        self.busy = [0.0] * len(engines)

    def reset(self) -> None:
        self.busy = [0.0] * len(self.engines)

    def offer(self, job, call):
        for k, slot in enumerate(self.slots):
            if slot.acquire(blocking=False):
                return DeviceTile(self, k, job, call.fingerprint)
        return DeviceTile(None, -1, job, call.fingerprint)  # refused


class DeviceTile:
    def __init__(self, peers: DevicePeers | None, k: int, job, fingerprint: str):
        self.messages: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        if peers is None:
            self.messages.put(None)
            return
        threading.Thread(target=self._decode, args=(peers, k, job, fingerprint), daemon=True).start()

    def _decode(self, peers: DevicePeers, k: int, job, fingerprint: str) -> None:
        from vae_service.engine.execution.peer_contract import Accepted, Chunk, End

        engine = peers.engines[k]
        try:
            engine.bind_thread()
            self.messages.put(Accepted(f"{engine.device}#{k}"))
            count, chunks = 0, engine.run_tile(job, fingerprint)
            while not self.cancelled.is_set():
                start = time.perf_counter()
                pixels = next(chunks, None)
                _sync(engine.device)
                peers.busy[k] += time.perf_counter() - start
                if pixels is None:
                    self.messages.put(End(count))
                    return
                count += 1
                self.messages.put(Chunk(pixels))
        except BaseException as error:  # handed to the engine, which fails the request with it
            self.messages.put(error)
        finally:
            peers.slots[k].release()

    def poll(self, timeout_s: float):
        from vae_service.engine.execution.peer_contract import TileRefused

        try:
            item = self.messages.get(timeout=timeout_s) if timeout_s > 0 else self.messages.get_nowait()
        except queue.Empty:
            return None
        if item is None:
            raise TileRefused("no device free")
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled.set()


def parse_devices(spec: str) -> list[str]:
    if spec == "all":
        count = torch.cuda.device_count()
        if count == 0:
            raise SystemExit("--devices all: no CUDA device visible (try --devices cpu,cpu)")
        return [f"cuda:{i}" for i in range(count)]
    return [d.strip() for d in spec.split(",") if d.strip()]


def auto_tile(h: int, w: int, devices: int) -> int:
    """Latent tile side whose busiest device decodes the fewest latent pixels, with at least
    max(2, devices) tiles: one device still tiles (to measure what that costs)."""
    best, best_cost = None, None
    for tile in range(MIN_TILE, max(h, w)):
        grid = TileGrid(tile, h, w)
        count = len(grid.tiles())
        if count < max(2, devices):
            continue
        cost = -(-count // devices) * grid.tile_h * grid.tile_w
        if best_cost is None or cost < best_cost:
            best, best_cost = tile, cost
    if best is None:
        raise SystemExit(f"{h}x{w} latent pixels: too small to tile")
    return best


def make_engines(model: str, devices: list[str], precision: str) -> list:
    from vae_service.config import ServiceConfig
    from vae_service.engine import DecodeEngine

    engines = []
    for device in devices:  # the same seed: the same random weights on every device
        cpu_threads = 1 if device.startswith("cpu") else None
        engines.append(
            DecodeEngine(ServiceConfig(model=model, device=device, cpu_threads=cpu_threads, decode_precision=precision))
        )
    return engines


def device_case(case: str, engines: list, tile_px: int | None, repeat: int) -> list:
    from dataclasses import replace

    from vae_service.engine import DecodeRequest

    model, height, width, frames = parse_case(case)
    here = engines[0]
    spec = here.spec
    if (frames is not None) != (spec.family == "video"):
        raise SystemExit(f"{case}: {model} is a {spec.family} model")
    scale = spec.spatial_scale
    z = latents(spec.latent_channels, scale, height, width, frames)
    h, w = z.shape[-2:]
    tile = tile_px // scale if tile_px else auto_tile(h, w, len(engines))
    request = DecodeRequest(z, quality="high", output="float", latents_scaled=True)
    here.bind_thread()
    untiled = here.prepare(request)
    grid = TileGrid(tile, h, w)
    if len(grid.tiles()) < 2:
        raise SystemExit(f"{case}: tiles of {tile * scale} px leave one tile; nothing to share")
    tiled = replace(untiled, tiling=grid)
    peers = DevicePeers(engines[1:])
    busiest = []

    def shared():
        peers.reset()
        result = here.decode([tiled], peers=peers)[0]
        busiest.append(max(peers.busy, default=0.0))
        return result

    def timed(fn):
        def run():
            _sync(here.device)
            out = fn()
            _sync(here.device)
            return out

        return run

    runs = {
        "untiled": timed(lambda: here.decode([untiled])[0]),
        "one": timed(lambda: here.decode([tiled])[0]),
        "shared": timed(shared),
    }
    seconds, answers = interleaved(runs, repeat)
    one, shared_result = answers["one"].output, answers["shared"].output
    if torch.equal(one, shared_result):
        identical = "yes"
    else:
        identical = f"NO, max |diff| {(one.float() - shared_result.float()).abs().max().item():.2e}"
    busy = statistics.median(busiest[1:])  # the timed rounds'
    n = len(engines)
    size = f"{height}x{width}" + ("" if frames is None else f" x {spec.output_frames(frames)} frames")
    return [
        model,
        size,
        here.precision,
        f"{len(grid.tiles())} x {grid.tile_h * scale}x{grid.tile_w * scale}",
        seconds["untiled"] if untiled.tiling is None else f"{seconds['untiled']:.3g} (tiled by the memory bound)",
        seconds["one"],
        seconds["shared"],
        seconds["one"] / seconds["shared"],
        seconds["untiled"] / seconds["shared"],
        busy,
        seconds["shared"] - seconds["one"] / n,
        answers["shared"].timing.replicas,
        identical,
    ]


def devices_mode(args) -> int:
    devices = parse_devices(args.devices)
    cases = args.cases or ([args.case] if args.case else GPU_CASES)
    if len(devices) == 1:
        print(f"! one device ({devices[0]}): the shared row shows what the tile executor costs, no speed-up")
    rows, engines, loaded = [], None, None
    for case in cases:
        model = parse_case(case)[0]
        if model != loaded:
            engines = None  # one model's engines at a time
            engines, loaded = make_engines(model, devices, args.precision), model
        rows.append(device_case(case, engines, args.tile_px, args.repeat))
        print(f"  done {case}", flush=True)
    n = len(devices)
    print_table(
        f"`high`, one request: untiled and tiled on {devices[0]} vs tiled over {n} devices "
        f"({', '.join(devices)}; float output, median of {args.repeat})",
        [
            "model",
            "size",
            "precision",
            "tiles (px)",
            "untiled s",
            "tiled, 1 device s",
            f"tiled, {n} devices s",
            "speed-up",
            "vs untiled",
            "busiest other device s",
            "over a perfect split s",
            "devices used",
            "identical",
        ],
        rows,
    )
    print(
        "speed-up: tiled on one device / tiled over all (the first device decodes the tiles no other took); "
        "busiest other device: its tile decodes (synchronized)"
    )
    return 0 if all(row[-1] == "yes" for row in rows) else 1  # gpu_check.sh fails on a bit-identity break


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="model:size[:latent_frames] (Serve mode: default sd:256)")
    parser.add_argument("--model", default="sd", help="Serve mode, without --case: the model")
    parser.add_argument("--size", type=int, default=256, help="Serve mode, without --case: output pixels per side")
    parser.add_argument("--tile-px", type=int, help="tile side in output px (Serve: 128; --devices: auto per case)")
    parser.add_argument("--replicas", type=int, default=2, help="Serve mode: replicas of the shared deployment")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds after a warm-up (3; --devices: 2)")
    parser.add_argument("--saturation", action="store_true", help="Serve mode: many clients, sharing on vs off")
    parser.add_argument("--clients", type=int, default=8, help="--saturation: clients at once")
    parser.add_argument("--requests", type=int, default=2, help="--saturation: requests per client per round")
    parser.add_argument("--kill", action="store_true", help="--saturation: a round that kills a replica mid-run")
    parser.add_argument(
        "--devices", nargs="?", const="all", help="engines in this process: all, cuda:0,cuda:1, cpu,cpu"
    )
    parser.add_argument("--cases", nargs="*", help=f"--devices mode: cases (default {' '.join(GPU_CASES)})")
    parser.add_argument("--precision", default="auto", help="--devices mode: decode_precision")
    args = parser.parse_args()
    if args.devices:
        args.repeat = args.repeat or 2
        return devices_mode(args)
    args.repeat = args.repeat or 3
    args.tile_px = args.tile_px or 128
    return serve_mode(args)


if __name__ == "__main__":
    sys.exit(main())
