"""One request across replicas or devices: a tiled `high` request decoded serially vs its tiles
spread, side by side in one run, with the same request untiled as a baseline (what tiling itself
costs). Images and Wan video (its tiles' chunk streams in lockstep); the same tile plan on both
sides (parallel.min_output_pixels); answers checked bit for bit.

Two modes:
- Serve (default): a local Ray Serve, three deployments of the model, every replica single-threaded
  (cpu_threads 1): untiled on one replica, tiled on one replica, tiled with its tiles spread over N
  replicas of its deployment (serving/tile_spread.py).
- `--devices` (no Ray; GPU machines): one DecodeEngine per device, in this process; a thread-based
  spreader deals the tiles round-robin to the engines, the request's own device included (tile 0),
  one tile at a time per device. Untiled on the first device, tiled serially on it, tiled over all
  of them. `--devices all` (default there): every visible CUDA device; `--devices cpu,cpu`: two CPU
  engines of one thread each (to try it without a GPU).

Prints the median wall time of each, the speed-up, what the spread costs over a perfect split, and
(`--devices`) the time beyond the busiest device's own tile decodes: blending, transfers, dispatch.
Presets use seeded random weights (they decode noise); speed does not depend on the weights.

Target (issue #20): two single-thread replicas >= 1.6x one on this CPU.
Cases: model:size[:latent_frames], size N or HxW, e.g. sd:256, wan2.1:96x96:2, wan2.1:480x832:21.
Usage: python bench/bench_parallel.py [--case sd:256] [--tile-px 128] [--replicas 2] [--repeat 3]
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
from collections.abc import Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_serve, print_table

from vae_service.engine.tiling import MIN_TILE, TileGrid, spread_grid

# Serve mode builds latents without loading the model here: presets with 8x spatial latents
LATENT_CHANNELS = {"sd": 4, "sdxl": 4, "flux": 16, "tiny-kl": 4, "wan2.1": 16, "tiny-wan": 4, "qwen-image": 16}
SCALE = 8
GPU_CASES = ["wan2.1:480x832:21", "wan2.1:720x1280:21", "sd:2048"]


def parse_case(case: str) -> tuple[str, int, int, int | None]:
    """model:size[:latent_frames] -> (model, height, width, latent frames or None for an image)."""
    model, size, *frames = case.split(":")
    height, width = (int(v) for v in size.split("x")) if "x" in size else (int(size), int(size))
    return model, height, width, int(frames[0]) if frames else None


def latents(channels: int, scale: int, height: int, width: int, frames: int | None) -> torch.Tensor:
    video = [] if frames is None else [frames]
    shape = [1, channels, *video, height // scale, width // scale]
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


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


def deploy(name: str, model: str, tile_px: int | None, replicas: int, spread: bool, base_url: str) -> str:
    from ray import serve

    from vae_service.serving.app import decoder_app

    parallel = {"tiles_across_replicas": spread}
    if tile_px is not None:
        parallel["min_output_pixels"] = tile_px * tile_px
    config = {"model": model, "model_name": name, "device": "cpu", "cpu_threads": 1, "parallel": parallel}
    scaling = {"min_replicas": replicas, "max_replicas": replicas, "initial_replicas": replicas}
    # no CPU reservation: Ray counts this machine's cores, and the apps' replicas outnumber them
    options = {"autoscaling_config": scaling, "ray_actor_options": {"num_cpus": 0}}
    serve.run(decoder_app(config, **options), name=name, route_prefix=f"/{name}")
    return f"{base_url}/{name}"


def serve_mode(args) -> int:
    from vae_service_client import VaeClient

    case = args.case or f"{args.model}:{args.size}"
    model, height, width, frames = parse_case(case)
    if model not in LATENT_CHANNELS:
        raise SystemExit(f"--case: Serve mode knows {sorted(LATENT_CHANNELS)}, not {model!r}")
    z = latents(LATENT_CHANNELS[model], SCALE, height, width, frames)
    grid = spread_grid(z.shape[-2], z.shape[-1], SCALE, args.tile_px * args.tile_px)
    if grid is None:
        raise SystemExit(f"--tile-px {args.tile_px}: {case} is one tile; nothing to spread")
    with local_serve() as base:
        urls = {
            "untiled": deploy("untiled", model, None, 1, False, base),
            "one": deploy("serial", model, args.tile_px, 1, False, base),
            "spread": deploy("spread", model, args.tile_px, args.replicas, True, base),
        }
        with contextlib.ExitStack() as stack:
            clients = {name: stack.enter_context(VaeClient(url, timeout=600)) for name, url in urls.items()}
            runs = {
                name: lambda c=client: c.decode(z, quality="high", output="uint8", scaling_factor=None)
                for name, client in clients.items()
            }
            seconds, answers = interleaved(runs, args.repeat)
    one, spread, untiled = answers["one"], answers["spread"], answers["untiled"]
    identical = np.array_equal(one.output, spread.output)
    if untiled.tiled or not one.tiled or not spread.tiled:
        print(f"! plans: untiled {untiled.tiled}, one {one.tiled}, spread {spread.tiled} (tiled?)")
    n = args.replicas
    size = f"{height}x{width}" + ("" if frames is None else f" x {frames} latent frames")
    print_table(
        f"{model} {size} `high`, {describe_grid(grid)}: untiled and tiled on one replica vs tiled over {n} "
        f"(cpu_threads 1 each, median of {args.repeat})",
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
                seconds["spread"],
                seconds["one"] / seconds["spread"],
                seconds["untiled"] / seconds["spread"],
                seconds["spread"] - seconds["one"] / n,
                spread.timing["replicas"],
                identical,
            ]
        ],
    )
    return 0 if identical else 1


# --- --devices mode: engines in this process, no Ray -------------------------------------------

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceTiles:
    """engine.decode's TileSpreader over engines of one model on devices of this process. Tile i
    goes to engine i mod N (tile 0 to the request's own), each tile on a thread of its own bound
    to its engine; a device decodes one tile's step at a time (a lock per device: a whole image
    tile, or one chunk of a video tile, so its video tiles advance together as the blend reads
    them). Outputs come back through queues of two (a tile ahead of the blend waits). `busy`: the
    seconds each device spent in its tiles' decodes (synchronized) since `reset`."""

    def __init__(self, engines: list):
        self.engines = engines
        self.locks = [threading.Lock() for _ in engines]
        self.busy = [0.0] * len(engines)

    def reset(self) -> None:
        self.busy = [0.0] * len(self.engines)

    def _deal(self, tiles: list[torch.Tensor], replicas: set, work: Callable) -> list[queue.Queue]:
        queues = []
        for i, tile in enumerate(tiles):
            k = i % len(self.engines)
            out: queue.Queue = queue.Queue(maxsize=2)
            threading.Thread(target=self._run, args=(k, tile, work, out), daemon=True).start()
            queues.append(out)
            replicas.add(f"{self.engines[k].device}#{k}")
        return queues

    def _run(self, k: int, tile: torch.Tensor, work: Callable, out: queue.Queue) -> None:
        engine = self.engines[k]
        try:
            engine.bind_thread()
            outputs = work(engine, tile)  # a generator: nothing runs before its first step
            while True:
                with self.locks[k]:
                    start = time.perf_counter()
                    step = next(outputs, _END)
                    _sync(engine.device)
                    self.busy[k] += time.perf_counter() - start
                out.put(step)
                if step is _END:
                    return
        except BaseException as error:  # handed to the blend, which raises it
            out.put(_Failed(error))

    @staticmethod
    def _read(out: queue.Queue) -> Iterator[torch.Tensor]:
        while True:
            step = out.get()
            if step is _END:
                return
            if isinstance(step, _Failed):
                raise step.error
            yield step

    def images(self, tiles: list[torch.Tensor], part: str, call, local) -> Iterator[torch.Tensor]:
        def work(engine, tile):
            yield engine.decode_tile(tile, part, call.fingerprint)

        return (next(self._read(out)) for out in self._deal(tiles, call.replicas, work))

    def chunks(
        self, tiles: list[torch.Tensor], quality: str, timestep: float | None, call, local
    ) -> list[Iterator[torch.Tensor]]:
        def work(engine, tile):
            return engine.tile_chunks(tile, quality, timestep, call.fingerprint)

        return [self._read(out) for out in self._deal(tiles, call.replicas, work)]


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


@contextlib.contextmanager
def spread_from(engine, pixels: int | None):
    """The engine's parallel.min_output_pixels for the requests prepared inside."""
    kept = engine.spread_from_pixels
    engine.spread_from_pixels = pixels
    try:
        yield
    finally:
        engine.spread_from_pixels = kept


def device_case(case: str, engines: list, tile_px: int | None, repeat: int) -> list:
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
    with spread_from(here, None):
        untiled = here.prepare(request)
    with spread_from(here, (tile * scale) ** 2):
        tiled = here.prepare(request)
    if tiled.tiling is None:
        raise SystemExit(f"{case}: tiles of {tile * scale} px leave one tile; nothing to spread")
    spreader = DeviceTiles(engines)
    busiest = []

    def spread():
        spreader.reset()
        result = here.decode([tiled], spread=spreader)[0]
        busiest.append(max(spreader.busy))
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
        "spread": timed(spread),
    }
    seconds, answers = interleaved(runs, repeat)
    one, spread_result = answers["one"].output, answers["spread"].output
    if torch.equal(one, spread_result):
        identical = "yes"
    else:
        identical = f"NO, max |diff| {(one.float() - spread_result.float()).abs().max().item():.2e}"
    busy = statistics.median(busiest[1:])  # the timed rounds'
    n = len(engines)
    grid = tiled.tiling
    size = f"{height}x{width}" + ("" if frames is None else f" x {spec.output_frames(frames)} frames")
    return [
        model,
        size,
        here.precision,
        f"{len(grid.tiles())} x {grid.tile_h * scale}x{grid.tile_w * scale}",
        seconds["untiled"] if untiled.tiling is None else f"{seconds['untiled']:.3g} (tiled by the memory bound)",
        seconds["one"],
        seconds["spread"],
        seconds["one"] / seconds["spread"],
        seconds["untiled"] / seconds["spread"],
        busy,
        seconds["spread"] - busy,
        seconds["spread"] - seconds["one"] / n,
        answers["spread"].timing.replicas,
        identical,
    ]


def devices_mode(args) -> int:
    devices = parse_devices(args.devices)
    cases = args.cases or ([args.case] if args.case else GPU_CASES)
    if len(devices) == 1:
        print(f"! one device ({devices[0]}): the spread row shows what dealing and blending cost, no speed-up")
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
            "busiest device s",
            "blend+transfer s",
            "over a perfect split s",
            "devices used",
            "identical",
        ],
        rows,
    )
    print(
        "speed-up: tiled on one device / tiled over all; busiest device: its own tile decodes (synchronized); "
        "blend+transfer: the spread's wall time beyond that (blending, copies between devices, dispatch)"
    )
    return 0 if all(row[-1] == "yes" for row in rows) else 1  # gpu_check.sh fails on a bit-identity break


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="model:size[:latent_frames] (Serve mode: default sd:256)")
    parser.add_argument("--model", default="sd", help="Serve mode, without --case: the model")
    parser.add_argument("--size", type=int, default=256, help="Serve mode, without --case: output pixels per side")
    parser.add_argument(
        "--tile-px", type=int, help="parallel.min_output_pixels = tile_px^2 (Serve: 128; --devices: auto per case)"
    )
    parser.add_argument("--replicas", type=int, default=2, help="Serve mode: replicas of the spread deployment")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds after a warm-up (3; --devices: 2)")
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
