"""The rows of the conformance suite (tests/unit/test_conformance.py): the ways a request can be
decoded, one `Row` each. Every column of the suite (a promise) runs on every row, so a new way of
decoding is a new row here and inherits every check.

The rows are not the full product of the axes (over a thousand ways, most of them minutes of
fp16 CPU decodes): `covering_rows` picks, greedily and cheapest first, rows until every value of
every axis appears and every meaningful pair of the risky axes (fallback x tiling, fallback x
stream, shared x model, stream x tiling, and the tier, tile and precision pairs in RISKY_PAIRS)
appears at least once. "Meaningful": some valid row holds the pair (`valid` says which rows make
sense: streams are video's, `tiling: model` is `lossless`', a fallback needs fp16, shared tiles a
tiled plan, ...).

Models (tests/models.py's overflowing tiny decoders, saved and loaded as the service loads them):
`kl` a tiny image AutoencoderKL, `wan` a tiny causal AutoencoderKLWan. Their first conv is scaled so
that latents OVERFLOW_LATENTS times larger overflow fp16 while fp32 stays finite, and latents of
unit size decode finite: a row's `fallback: triggered` scales its `overflow` items (video: from
latent frame `overflow_from` on), `off` scales nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

AXES: dict[str, tuple[str, ...]] = {
    "model": ("kl", "wan"),  # tiny image KL / tiny causal video Wan
    "precision": ("fp32", "fp16"),
    "quality": ("lossless", "high", "preview"),
    # how the request asks to be tiled, and the bound it is planned under: "auto" under the default
    # bound decodes whole, "auto-tight" under a bound below its whole price decodes tiled (`high`: a
    # tile grid, `lossless`: the class's own tiled decode), "model" the class's tiled decode, "none"
    # never tiled
    "plan": ("auto", "auto-tight", "model", "none"),
    "stream": ("none", "frames", "mp4", "webm"),
    "fallback": ("off", "triggered"),
    "tiles": ("local", "shared"),  # shared: with an in-process peer replica (tests/peers.py)
    "output": ("uint8", "float"),  # a video stream answers its container
}
VIDEOS = ("mp4", "webm")  # the streamed video containers (serving/outputs/video_stream.py)

# pairs of axes every one of whose meaningful value pairs some row holds
RISKY_PAIRS = [
    ("fallback", "plan"),
    ("fallback", "stream"),
    ("fallback", "quality"),
    ("fallback", "model"),
    ("fallback", "tiles"),
    ("tiles", "model"),
    ("tiles", "quality"),
    ("tiles", "stream"),
    ("stream", "plan"),
    ("stream", "quality"),
    ("quality", "plan"),
    ("precision", "model"),
]

# rough cost of a row (its decodes, references, the peak run and two stopped runs), in latent
# pixels decoded: fp16 convolutions are ~10x slower than fp32 on a CPU, tiled plans decode
# overlapping tiles, each row has a fixed overhead
_FP16_SLOWER = 10.0
_ROW_OVERHEAD_PX = 300.0


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # "kl" (image) | "wan" (causal video)
    precision: str  # the deployment's: "fp32" | "fp16"
    quality: str  # "lossless" | "high" | "preview"
    tiling: str  # the request's: "auto" | "model" | "none"
    bound: str  # "default" (the engine's) | "tight" (below the whole decode's price: tiled)
    stream: str  # "none" | "frames" (FrameStream) | "mp4" | "webm" (VideoStream)
    fallback: str  # "off" | "triggered" (items overflow fp16: the fp32 fallback answers them)
    tiles: str  # "local" | "shared" (with an in-process peer replica)
    output: str  # "uint8" | "float" | "mp4" | "webm"
    latent: tuple[int, ...]  # the request's latents, decoder layout
    overflow: tuple[int, ...] = ()  # items scaled to overflow fp16 (fallback: triggered)
    overflow_from: int = 0  # video: the first latent frame scaled (frames before it decode finite)

    @property
    def video(self) -> bool:
        return self.model == "wan"

    @property
    def items(self) -> int:
        return self.latent[0]

    @property
    def triggered(self) -> bool:
        return self.fallback == "triggered"

    @property
    def shared(self) -> bool:
        return self.tiles == "shared"

    @property
    def streamed(self) -> bool:
        return self.stream != "none"


def valid(way: dict[str, str]) -> bool:
    model, precision, quality, plan = way["model"], way["precision"], way["quality"], way["plan"]
    stream, fallback, tiles = way["stream"], way["fallback"], way["tiles"]
    if stream != "none" and model != "wan":  # streams are video's
        return False
    if plan == "model" and quality != "lossless":  # the class's own tiled decode is a lossless decode
        return False
    if quality == "preview" and (plan != "auto" or fallback != "off" or tiles != "local"):
        return False  # no VAE: never tiled, never falls back, nothing to share
    if fallback == "triggered" and precision != "fp16":  # an fp32 deployment has nothing to fall back to
        return False
    if tiles == "shared" and plan not in ("auto-tight", "model"):  # only a tiled plan has tiles to share
        return False
    # Wan at fp16 only whole: its tiled plans need tiles of 8+ latent px (32+ for its class's own
    # tiled decode), seconds per fp16 CPU decode, and the fp32 fallback's plan beside them
    return not (model == "wan" and precision == "fp16" and plan in ("auto-tight", "model"))


def cost(way: dict[str, str]) -> float:
    shape = latent_shape(way)
    pixels = shape[0] * (shape[2] if len(shape) == 5 else 1) * shape[-2] * shape[-1]
    if way["plan"] in ("auto-tight", "model"):
        pixels *= 2.5  # overlapping tiles
    if way["precision"] == "fp16":
        pixels *= _FP16_SLOWER
    cost = pixels + _ROW_OVERHEAD_PX
    if way["tiles"] == "shared":
        cost *= 1.5
    if way["stream"] != "none":
        cost *= 1.3
    if way["fallback"] == "triggered":
        cost *= 1.3
    return cost


def _ways() -> list[dict[str, str]]:
    ways = []
    for values in itertools.product(*AXES.values()):
        way = dict(zip(AXES, values, strict=True))
        if way["stream"] in VIDEOS:
            if way["output"] != "uint8":  # a video stream has one output: its container
                continue
            way["output"] = way["stream"]
        if valid(way):
            ways.append(way)
    return ways


def _needs(way: dict[str, str]) -> set[tuple]:
    singles = {((axis, way[axis]),) for axis in AXES if axis != "output" or way["output"] not in VIDEOS}
    pairs = {((a, way[a]), (b, way[b])) for a, b in RISKY_PAIRS}
    return singles | pairs


def covering_ways() -> list[dict[str, str]]:
    """Greedy set cover: the way covering the most uncovered needs per second, until all are
    covered (every need some valid way holds). Deterministic: ties go to the earlier way."""
    ways = _ways()
    needs = [_needs(way) for way in ways]
    uncovered = set().union(*needs)
    chosen = []
    while uncovered:
        best = max(range(len(ways)), key=lambda i: (len(needs[i] & uncovered) / cost(ways[i]), -i))
        chosen.append(ways[best])
        uncovered -= needs[best]
    return chosen


def latent_shape(way: dict[str, str]) -> tuple[int, ...]:
    """Small shapes that still plan what the row names (checked when the row is prepared): the
    class's tiled decode needs more than a tile (tiny KL: 8 latent px, Wan: 32), a `high` tile grid
    tiles of 8+ latent px (Wan in lockstep: two tiles over 24 px), the fp32 fallback's tiled plan
    room under a tight fp16 bound (KL: 16 px and more)."""
    model, precision, quality, plan = way["model"], way["precision"], way["quality"], way["plan"]
    fp16, tight = precision == "fp16", plan == "auto-tight"
    one = way["stream"] in VIDEOS or (way["fallback"] == "triggered" and (model == "wan" or quality == "high"))
    if model == "kl":
        if tight and quality == "lossless":
            hw = (16, 16) if fp16 else (12, 10)
        elif tight:  # a `high` grid
            hw = (20, 18) if fp16 else (24, 20)
        else:
            hw = (9, 9) if fp16 else (9, 11)
        items = 1 if one or (fp16 and way["fallback"] == "off") or tight or plan == "model" else 2
        return (items, 4, *hw)
    if plan == "model" or (tight and quality == "lossless"):
        return (1, 4, 1, 33, 9)  # two of Wan's 32-latent-px class tiles
    if tight:
        return (1, 4, 2, 24, 9)  # a `high` grid of two tiles that fits in lockstep
    return (1, 4, 2, 4, 5) if fp16 or one else (2, 4, 3, 4, 5)


def row_of(way: dict[str, str]) -> Row:
    plan = way["plan"]
    tiling, bound = ("auto", "tight") if plan == "auto-tight" else (plan, "default")
    latent = latent_shape(way)
    overflow, overflow_from = (), 0
    if way["fallback"] == "triggered":
        overflow = (latent[0] - 1,)  # the last item; another one (if any) decodes finite
        overflow_from = 1 if way["model"] == "wan" else 0  # video: a first latent frame decodes (and streams) finite
    parts = (way["model"], way["precision"], way["quality"], plan, f"stream:{way['stream']}")
    name = "-".join((*parts, f"fallback:{way['fallback']}", way["tiles"], way["output"]))
    return Row(
        name, way["model"], way["precision"], way["quality"], tiling, bound, way["stream"], way["fallback"],
        way["tiles"], way["output"], latent, overflow, overflow_from,
    )  # fmt: skip


def covering_rows() -> list[Row]:
    return [row_of(way) for way in covering_ways()]


ROWS = covering_rows()
