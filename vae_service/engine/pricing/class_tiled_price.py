"""The price of `lossless` above the memory bound: the class's own tiled decode (bit-identical to
`vae.enable_tiling(); vae.decode`), priced from its tile grid (models/class_tiling.py) in constant
work per request instead of running it on the meta twin tile by tile (which took 32 s for a 1024 px
tiny-kl request, seconds more per shape for video).

A class tiled decode decodes its tiles one after another and keeps every tile's output until it
blends them, then blends into rows and joins them. Its peak is the larger of two phases:
- decoding tile k: the outputs of the tiles before it, and tile k's own decode (`TileWorking`: the
  class's plain decode of a latent that size, a plane in latent pixels and pixels x output frames
  fitted on the twin at start-up);
- blending: every tile's output, and `kappa` outputs' worth of blend buffers (AutoencoderKL: the
  rows and the joined answer, 2; Wan: 3) with a constant, fitted at start-up on tiled decodes on
  the twin whose decoder answers empty outputs (shapes only).
Checked at start-up against a whole tiled decode counted on the twin (within `FIT_TOLERANCE`, the
grid's decoder calls as read).

Where the request's replica shares the decode (models/diffusers_tiling.py's `tiled_decode_elsewhere`,
its decoder calls made by the deployment's replicas), it holds more than that: every tile's decoder
input, recorded before the replay and kept through it (latent-sized: in `working` whichever runs),
and, while it decodes tile k itself, the outputs of up to `TILE_WINDOW - 1` tiles after k that
replicas decoded ahead of the blend (engine/execution/tile_executor.py's window): `shared_working`,
the price of a shared plan.

 a class whose grid is not read, or whose check fails, and clips
long enough for a class to tile time too, are priced per shape on the twin (`PerShapeClassTiled`:
bounded cache, clips past `LONG_CLIP` extrapolated) off the event loop, under the request's context
(a run stops within one op of its end: engine/pricing/memory.py's LiveBytes).

A per-shape price is kept by the class's tile grid rather than by the latent's pixels
(models/class_tiling.py's `ClassGrid.priced_at`): a shape is priced at the largest one with as many
tiles per side, its last tile rounded up to the grid's overlap, so that shapes a few pixels apart
share one run (62x60 and 62x61 latents of HunyuanVideo's grid both at 64x64) and the price never
falls short of theirs (every tile and the output only grow). The fit is made once per architecture
for every later request: it runs unchecked, whoever's request first needs it.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from vae_service.engine.pricing.memory import PRICED_SHAPES, LiveBytes, ModelFacts, TwinRun
from vae_service.engine.runtime.tile_jobs import TILE_WINDOW
from vae_service.models.class_tiling import ClassGrid, class_grid
from vae_service.models.decoder_shapes import META_ERRORS
from vae_service.models.probe_cache import checked_by
from vae_service.models.probe_store import Codec, integer, number, sized
from vae_service.models.spec import ModelSpec

log = logging.getLogger(__name__)

FIT_TOLERANCE = 0.1
STEADY = 0  # the regime of clips of `ModelFacts.frames` latent frames and more
LONG_CLIP = 12  # latent frames: a per-shape price beyond, extrapolated from two probes
LONG_CLIP_PROBES = (LONG_CLIP // 2, LONG_CLIP)
TILED_IN_TIME = "clips this long are tiled in time as well"


class ClassTiledPrice:
    def working(self, h: int, w: int, latent_frames: int = 1) -> int:
        """The decode here, tile after tile (with the inputs a shared decode records)."""
        raise NotImplementedError

    def shared_working(self, h: int, w: int, latent_frames: int = 1) -> int:
        """The decode shared with replicas: `working`, or more where the tiles replicas decoded
        ahead of the blend are held while this device decodes one."""
        return self.working(h, w, latent_frames)

    def needs_shape_work(self, h: int, w: int, latent_frames: int = 1) -> bool:
        return False

    def describe(self) -> dict:
        raise NotImplementedError


class PerShapeClassTiled(ClassTiledPrice):
    """The tiled decode run on the twin per place in the class's grid (`grid`; None: not read, per
    shape) and clip length (kept: PRICED_SHAPES)."""

    def __init__(self, run: TwinRun, spec: ModelSpec, why: str, grid: ClassGrid | None = None):
        self.run, self.spec, self.why, self.grid = run, spec, why, grid
        self._priced: OrderedDict[tuple[int, int, int], int] = OrderedDict()
        self._lock = threading.Lock()

    def _key(self, h: int, w: int, latent_frames: int) -> tuple[int, int, int]:
        """The shape this one is priced at: its place in the grid, or itself."""
        side = self.run.facts.min_side
        h, w = max(h, side), max(w, side)
        if self.grid is not None:
            h, w = self.grid.priced_at(h, w)
        return h, w, latent_frames if self.run.facts.video else 1

    def _measured(self, h: int, w: int, latent_frames: int) -> int:
        key = (h, w, latent_frames)
        with self._lock:
            if key in self._priced:
                self._priced.move_to_end(key)
                return self._priced[key]
        peak, _ = self.run.run(1, h, w, latent_frames)
        with self._lock:
            self._priced[key] = peak
            while len(self._priced) > PRICED_SHAPES:
                self._priced.popitem(last=False)
        return peak

    def needs_shape_work(self, h: int, w: int, latent_frames: int = 1) -> bool:
        h, w, t = self._key(h, w, latent_frames)
        probes = [(h, w, t)] if t <= LONG_CLIP else [(h, w, p) for p in LONG_CLIP_PROBES]
        return any(key not in self._priced for key in probes)

    def working(self, h: int, w: int, latent_frames: int = 1) -> int:
        tiles = self.grid.tiles(h, w) if self.grid is not None else None
        inputs = _input_bytes(self.run.facts, tiles, latent_frames) if tiles else 0
        return self._local(h, w, latent_frames) + inputs

    def shared_working(self, h: int, w: int, latent_frames: int = 1) -> int:
        tiles = self.grid.tiles(h, w) if self.grid is not None else None
        if self.grid is None:  # its tiles unknown: every output of the window as large as the whole
            return self.working(h, w, latent_frames) + (TILE_WINDOW - 1) * h * w * _output_bytes(
                self.run.facts, self.spec, latent_frames
            )
        if tiles is None:  # decoded whole: nothing shared
            return self.working(h, w, latent_frames)
        # beside the local decode's peak, the window's outputs, each as large as the largest tile's
        ahead = (TILE_WINDOW - 1) * max(th * tw for th, tw in tiles)
        return self.working(h, w, latent_frames) + ahead * _output_bytes(self.run.facts, self.spec, latent_frames)

    def _local(self, h: int, w: int, latent_frames: int) -> int:
        # past LONG_CLIP latent frames on the line through two probes: the tiles' held frames
        # dominate the decoder's working set by then
        h, w, t = self._key(h, w, latent_frames)
        if t <= LONG_CLIP:
            return self._measured(h, w, t)
        out = self.spec.output_frames
        (f1, p1), (f2, p2) = [(out(t), self._measured(h, w, t)) for t in LONG_CLIP_PROBES]
        return math.ceil(p2 + (p2 - p1) / (f2 - f1) * (out(t) - f2))  # an extrapolation: never under it

    def describe(self) -> dict:
        return {"priced": "per shape", "why": self.why}


@dataclass(frozen=True)
class TileWorking:
    """The class's decode of one tile: w0 + w1 * P + w2 * P * F (P latent pixels, F output frames)."""

    w0: float
    w1: float
    w2: float

    def __call__(self, pixels: int, frames: int) -> float:
        return self.w0 + self.w1 * pixels + self.w2 * pixels * frames


@dataclass(frozen=True)
class Regime:
    """One regime's fit: a tile's decode, and the blend buffers beside the tiles' outputs (`kappa`
    outputs' worth, and `per_frame` bytes per output frame: a tile's frames kept by the blend)."""

    tile: TileWorking
    kappa: float
    per_frame: float


class FormulaClassTiled(ClassTiledPrice):
    def __init__(
        self,
        grid: ClassGrid,
        regimes: dict[int, Regime],
        spec: ModelSpec,
        pixel_bytes: int,
        fallback: PerShapeClassTiled,
    ):
        """`regimes`: by clip length in latent frames, for the short clips fitted alone (a causal
        decoder's first chunk runs without history, its second holds the first's: Wan2.2's tile
        holds 15, 53, 62, 65 MB at 1-4 latent frames, a line only from the third on), and under
        STEADY the plane for every longer clip."""
        self.grid, self.regimes, self.spec = grid, regimes, spec
        self.pixel_bytes = pixel_bytes  # bytes of one latent pixel's decoded output, per frame
        self.fallback = fallback  # clips the class tiles in time as well

    def _frames(self, latent_frames: int) -> int:
        return self.spec.output_frames(latent_frames) if self.spec.geometry.video_latents else 1

    def regime(self, latent_frames: int) -> Regime:
        return self.regimes.get(latent_frames) or self.regimes[STEADY]

    def needs_shape_work(self, h: int, w: int, latent_frames: int = 1) -> bool:
        return self.grid.tiles_time(latent_frames) and self.fallback.needs_shape_work(h, w, latent_frames)

    def working(self, h: int, w: int, latent_frames: int = 1) -> int:
        if self.grid.tiles_time(latent_frames):
            return self.fallback.working(h, w, latent_frames)
        tiles = self.grid.tiles(h, w)
        inputs = _input_bytes(self.fallback.run.facts, tiles, latent_frames) if tiles else 0
        return self.local_working(h, w, latent_frames) + inputs

    def shared_working(self, h: int, w: int, latent_frames: int = 1) -> int:
        if self.grid.tiles_time(latent_frames):
            return self.fallback.shared_working(h, w, latent_frames)
        local = self.local_working(h, w, latent_frames)
        tiles = self.grid.tiles(h, w)
        if tiles is None:  # decoded whole: nothing to share
            return local
        regime, frames = self.regime(latent_frames), self._frames(latent_frames)
        per_pixel = self.pixel_bytes * frames
        outputs = [th * tw * per_pixel for th, tw in tiles]
        shared = 0.0
        for k, (th, tw) in enumerate(tiles):  # tile k decoded here: the tiles before it and the window's after it
            held = sum(outputs[:k]) + sum(outputs[k + 1 : k + TILE_WINDOW])
            shared = max(shared, held + _decoding(regime, th * tw, frames, per_pixel))
        inputs = _input_bytes(self.fallback.run.facts, tiles, latent_frames)
        return round(max(local, shared) + inputs)

    def local_working(self, h: int, w: int, latent_frames: int = 1) -> int:
        """The class's own tiled decode, tile after tile (what the fit is checked against)."""
        regime, frames = self.regime(latent_frames), self._frames(latent_frames)
        per_pixel = self.pixel_bytes * frames
        tiles = self.grid.tiles(h, w)
        if tiles is None:  # the class decodes these latents whole
            return round(_decoding(regime, h * w, frames, per_pixel))
        held = decoding = 0.0
        for pixels in (th * tw for th, tw in tiles):
            decoding = max(decoding, held + _decoding(regime, pixels, frames, per_pixel))
            held += pixels * per_pixel
        # to the nearest byte, not truncated: a fit through a measured peak lands a float's noise
        # below or above it (truncation priced such a decode a byte under what it held)
        return round(max(decoding, held + regime.kappa * h * w * per_pixel + regime.per_frame * frames))

    def describe(self) -> dict:
        g = self.grid
        return {
            "priced": "by the class's tile grid",
            "tile": [g.height.tile, g.width.tile],
            "stride": [g.height.stride, g.width.stride],
            "blend_outputs": round(self.regimes[STEADY].kappa, 3),
        }


def _output_bytes(facts: ModelFacts, spec: ModelSpec, latent_frames: int) -> int:
    """Bytes of the decoded output of one latent pixel (every output frame)."""
    frames = spec.output_frames(latent_frames) if facts.video else 1
    return 3 * facts.itemsize * facts.scale**2 * frames


def _input_bytes(facts: ModelFacts, tiles: list[tuple[int, int]], latent_frames: int) -> int:
    """Every tile's decoder input (each latent frame), as the shared decode records and keeps them."""
    frames = latent_frames if facts.video else 1
    return sum(th * tw for th, tw in tiles) * facts.latent_channels * facts.itemsize * frames


def _decoding(regime: Regime, pixels: int, frames: int, per_pixel: float) -> float:
    """One tile's decode, never under its own output (the fit is a plane through small tiles)."""
    return max(regime.tile(pixels, frames), pixels * per_pixel)


class _FirstTileDone(Exception):
    """Stops a probe once its first tile is decoded: what comes after is not measured."""


class _Undescribed(Exception):
    """A decoder call argument that `_described` cannot name by shape."""


def _described(value):
    """A hashable account of a call argument by its shapes and values (tensors by shape and dtype)."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype, value.device.type
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_described(v) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((k, _described(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return "value", type(value).__name__, value  # the type: True and 1 are equal keys
    raise _Undescribed(type(value).__name__)


def _rebuilt(account):
    """`_described`'s value again, its tensors empty (only shapes are read where it is used)."""
    kind = account[0]
    if kind == "tensor":
        return torch.empty(account[1], dtype=account[2], device=account[3])
    if kind == "list":
        return [_rebuilt(a) for a in account[1]]
    if kind == "tuple":
        return tuple(_rebuilt(a) for a in account[1])
    if kind == "dict":
        return {k: _rebuilt(a) for k, a in account[1]}
    return account[2]


def _mutable(args: tuple, kwargs: dict) -> list:
    """The lists and dicts a call can change in place (a causal decoder's cache and its index)."""
    found, stack = [], [*args, *kwargs.values()]
    while stack:
        value = stack.pop(0)
        if isinstance(value, (list, dict)):
            found.append(value)
        elif isinstance(value, tuple):
            stack.extend(value)
    return found


def _restore(containers: list, changes: list[tuple[int, tuple]]) -> None:
    """Leaves the containers a call changed as it left them (the others keep what they hold: a
    cache the decoder answers rather than changes stays counted as its output was)."""
    for index, account in changes:
        container = containers[index]
        if isinstance(container, list):
            container[:] = _rebuilt(account)
        else:
            container.clear()
            container.update(_rebuilt(account))


class _ShapesOnly(nn.Module):
    """A decoder that answers empty outputs of the real one's shapes (the real one run with the
    byte count off), except its first `real` calls, decoded as they are and counted; with
    `stop`, the decode ends after those. It notes the spatial shape of every call.

    `answers` is shared by a fit's probes: a call whose arguments (the cache it is handed
    included) have the shapes of one seen before gets that call's output shapes and leaves the
    cache as that call left it, without running the decoder again (a 16-tile grid has at most 4
    tile shapes, and a causal decoder's cache stops changing shape after two frames). A decoder
    that keeps other state of its own would be priced wrong here: the fit's closing check, a whole
    tiled decode counted, then prices the class per shape."""

    def __init__(self, real_decoder: nn.Module, answers: dict, real: int = 0, stop: bool = False):
        super().__init__()
        self.real_decoder, self.answers, self.real, self.stop = real_decoder, answers, real, stop
        self.shapes: Counter = Counter()

    def forward(self, *args, **kwargs):
        calls = sum(self.shapes.values())
        if self.stop and calls >= self.real:
            raise _FirstTileDone
        self.shapes[tuple(args[0].shape[-2:])] += 1
        if calls < self.real:
            return self.real_decoder(*args, **kwargs)
        try:
            key = _described((args, kwargs))
        except _Undescribed:
            key = None
        containers = _mutable(args, kwargs)
        with _disable_current_modes():  # the decoder's own cache is not counted
            if key in self.answers:
                output, changes = self.answers[key]
                _restore(containers, changes)
            else:
                before = [_described(c) for c in containers] if key is not None else None
                out = self.real_decoder(*args, **kwargs)
                try:
                    output, after = _described(out), [_described(c) for c in containers]
                except _Undescribed:
                    output = None
                if key is not None and output is not None:
                    changes = [(i, a) for i, (b, a) in enumerate(zip(before, after, strict=True)) if a != b]
                    self.answers[key] = output, changes
        if output is None:
            return pytree.tree_map_only(torch.Tensor, _empty_like, out)
        return _rebuilt(output)  # counted: the tile's output (and a cache it returns) is held


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _with_decoder(view: nn.Module, decoder: nn.Module) -> nn.Module:
    probe = copy.copy(view)
    probe.__dict__["_modules"] = view._modules.copy()  # copy.copy shares `_modules`
    probe.decoder = decoder
    return probe


def _as_read(calls: Counter, tiles: list[tuple[int, int]]) -> int | None:
    """The decoder calls per tile, where the calls are the grid's tiles, each called alike."""
    expected = Counter(tiles)
    if set(calls) != set(expected):
        return None
    ratios = {calls[shape] / expected[shape] for shape in expected}
    ratio = ratios.pop() if len(ratios) == 1 else 0
    return int(ratio) if ratio >= 1 and ratio == int(ratio) else None


class _Probe:
    """Runs the class's tiled decode on the twin with a decoder of `_ShapesOnly`: the peak bytes
    and the decoder's calls."""

    def __init__(self, view: nn.Module, tiled: TwinRun):
        self.view, self.tiled = view, tiled
        self.answers: dict = {}  # the decoder's calls by shape, shared by the fit's probes

    def run(self, h: int, w: int, frames: int, real: int = 0, stop: bool = False) -> tuple[int, Counter]:
        decoder = _ShapesOnly(self.view.decoder, self.answers, real, stop)
        facts = self.tiled.facts
        z = torch.empty(
            1, facts.latent_channels, *((frames,) if facts.video else ()), h, w, device="meta", dtype=facts.dtype
        )
        live = LiveBytes()
        try:
            with self.tiled._lock, torch.inference_mode(), live:
                for out in self.tiled.decode(_with_decoder(self.view, decoder), z):
                    del out
        except _FirstTileDone:
            pass
        return live.peak, decoder.shapes


def fit_class_tiled(view: nn.Module, tiled: TwinRun, spec: ModelSpec) -> ClassTiledPrice:
    """`view`: the twin with its class's tiling on; `tiled` runs its decode. Unchecked: made once
    for every later request, even where a request's price is the first to need it."""
    grid = class_grid(view)
    if grid is None:
        return PerShapeClassTiled(tiled, spec, "the class's tile grid is not read")
    try:
        with checked_by(None):
            return _fit(view, grid, tiled, spec)
    except META_ERRORS as exc:  # a class whose tiled decode does not run so on the meta device
        log.warning("%s's tiled decode is priced per shape: %s: %s", spec.class_name, type(exc).__name__, exc)
        return PerShapeClassTiled(tiled, spec, f"its fit failed ({type(exc).__name__})")  # grid unconfirmed


def _clip_lengths(grid: ClassGrid, first: int, least: int) -> tuple[int, ...]:
    """Two clip lengths (latent frames, more than one) to fit a tile's decode on, neither tiled in time."""
    for other in (2 * first, first + 1, first - 1):
        if other >= max(2, least) and other != first and not grid.tiles_time(other):
            return first, other
    return (first,)


class _Unread(Exception):
    """The decoder's calls are not the grid's tiles."""


def _fit_regime(probe: _Probe, grid: ClassGrid, clips: tuple[int, ...], out, pixel_bytes: int, min_side: int) -> Regime:
    """A tile's decode fitted on grids whose first tile is whole, short or narrow (each measured as
    the first tile: nothing held before it, the decode stopped after it), and the blend buffers
    fitted on grids of 4, 6 and 16 tiles with every tile answered by shape."""
    th, tw, sh, sw = grid.height.tile, grid.width.tile, grid.height.stride, grid.width.stride
    small_h, small_w = max(min_side, th // 2), max(min_side, tw // 2 + 1)
    square = (sh + max(1, th // 2), sw + max(1, tw // 2))  # two tiles a side, the second cut short
    firsts = {(th, tw): square, (small_h, tw): (small_h, tw + sw // 2), (th, small_w): (th + sh // 2, small_w)}
    rows, ys, blends = [], [], []
    for t in clips:
        per_pixel = pixel_bytes * out(t)
        per_tile = None
        for h, w in (square, (2 * sh + max(1, th // 3), sw + max(1, tw // 3)), (3 * sh + 1, 3 * sw + 2)):
            tiles = grid.tiles(h, w)
            blend_peak, shapes = probe.run(h, w, t)
            per_tile = _as_read(shapes, tiles)
            if per_tile is None:
                raise _Unread(f"the decoder calls {dict(shapes)} are not the grid's tiles {tiles}")
            blends.append((h * w * per_pixel, out(t), blend_peak - sum(a * b for a, b in tiles) * per_pixel))
        for (ah, aw), (h, w) in firsts.items():
            rows.append([1.0, ah * aw, ah * aw * out(t)])
            ys.append(probe.run(h, w, t, real=per_tile, stop=True)[0])
    design, values = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    if len(clips) == 1:  # one clip length: P and P * F are one column
        design = design[:, :2]
    solution = torch.linalg.lstsq(design, values[:, None]).solution.flatten().tolist()
    tile = TileWorking(*solution) if len(solution) == 3 else TileWorking(solution[0], solution[1], 0.0)
    outputs = torch.tensor([[o, f] for o, f, _ in blends], dtype=torch.float64)
    extra = torch.tensor([[e] for _, _, e in blends], dtype=torch.float64)
    kappa, per_frame = torch.linalg.lstsq(outputs, extra).solution.flatten().tolist()
    return Regime(tile, max(0.0, kappa), max(0.0, per_frame))


def _fit(view: nn.Module, grid: ClassGrid, tiled: TwinRun, spec: ModelSpec) -> ClassTiledPrice:
    fallback = PerShapeClassTiled(tiled, spec, TILED_IN_TIME, grid)
    facts, probe = tiled.facts, _Probe(view, tiled)
    out = spec.output_frames if facts.video else (lambda t: 1)
    pixel_bytes = 3 * facts.itemsize * facts.scale**2
    fit = functools.partial(_fit_regime, probe, grid, out=out, pixel_bytes=pixel_bytes, min_side=facts.min_side)
    try:
        if spec.family == "image":  # one latent frame, always (Qwen-Image's video decoder too)
            regimes = {STEADY: fit((1,))}
        else:
            least = spec.geometry.min_latent_frames
            regimes = {STEADY: fit(_clip_lengths(grid, facts.frames, least))}
            regimes.update({t: fit((t,)) for t in range(least, facts.frames)})
    except _Unread as exc:  # the decoder's calls are not the grid's: priced per shape, not by the grid
        log.warning("%s's tiled decode is priced per shape: %s", spec.class_name, exc)
        return PerShapeClassTiled(tiled, spec, str(exc))
    price = FormulaClassTiled(grid, regimes, spec, pixel_bytes, fallback)
    # the check: a whole tiled decode counted on the twin, at a grid none of the fits used
    th, tw, sh, sw = grid.height.tile, grid.width.tile, grid.height.stride, grid.width.stride
    h, w, t = sh + max(1, th // 3), sw + max(1, tw // 4), facts.frames if spec.family == "video" else 1
    counted, _ = tiled.run(1, h, w, t)
    estimate = price.local_working(h, w, t)
    if abs(estimate - counted) > FIT_TOLERANCE * counted:
        why = f"the grid's price {estimate} B vs {counted} B counted at {h}x{w}x{t}"
        log.warning("%s's tiled decode is priced per shape: %s", spec.class_name, why)
        return PerShapeClassTiled(tiled, spec, why, grid)
    return price


def class_tiled_codec(view: nn.Module, tiled: TwinRun, spec: ModelSpec) -> Codec[ClassTiledPrice]:
    """What the probe store keeps of a fit (models/probe_store.py): the regimes' numbers, or why the
    class is priced per shape; the grid is read from `view` again (diffusers' tile settings)."""

    def encode(price: ClassTiledPrice) -> dict:
        if isinstance(price, FormulaClassTiled):
            regimes = [[t, [r.tile.w0, r.tile.w1, r.tile.w2, r.kappa, r.per_frame]] for t, r in price.regimes.items()]
            return {"regimes": regimes, "pixel_bytes": price.pixel_bytes}
        return {"per_shape": price.why, "by_grid": price.grid is not None}

    def decode(data: dict) -> ClassTiledPrice:
        grid = class_grid(view)
        if "per_shape" in data:
            if not isinstance(data["per_shape"], str):
                raise ValueError(f"per_shape: expected a reason, got {data['per_shape']!r}")
            if not isinstance(data["by_grid"], bool):
                raise ValueError(f"by_grid: expected a boolean, got {data['by_grid']!r}")
            return PerShapeClassTiled(tiled, spec, data["per_shape"], grid if data["by_grid"] else None)
        regimes = {}
        for clip, numbers in data["regimes"]:
            w0, w1, w2, kappa, per_frame = map(number, sized(numbers, 5))
            regimes[integer(clip)] = Regime(TileWorking(w0, w1, w2), kappa, per_frame)
        if grid is None or STEADY not in regimes:
            raise ValueError("no tile grid, or no steady regime")
        fallback = PerShapeClassTiled(tiled, spec, TILED_IN_TIME, grid)
        return FormulaClassTiled(grid, regimes, spec, integer(data["pixel_bytes"]), fallback)

    return Codec(encode, decode)
