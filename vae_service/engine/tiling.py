"""Spatially tiled decode for `high` requests over the memory bound: overlapping latent tiles, each
decoded on its own, blended with linear ramps across every overlap (the weights of the tiles
covering a pixel sum to one). Video keeps its temporal chunking, in one of two orders:

- lockstep: every tile runs its own chunk decoder (its own causal history) and all advance one
  latent frame at a time, so a tiled video still streams chunk by chunk; but every tile's history
  is held at once, and Wan's history is about half its peak (engine/memory.py), so this bounds
  memory only down to about that;
- tile after tile: one tile's history at a time, the blended clip held in fp32 until the last
  tile is done (frames are handed over only then). Chosen when lockstep cannot fit the bound.

The tiles see less context than the whole latent (convolution borders, and Wan's and SD's
attention mid-blocks are global), so tiled output differs from untiled; docs/performance.md gives the
error measured and the tests bound it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from vae_service.engine.memory import TierPrice

MIN_TILE = 8  # latent pixels per side


OVERLAP_FRACTION = 4  # overlap = tile // 4, like diffusers' tiled decoders


def _starts(size: int, tile: int, stride: int) -> list[int]:
    if tile >= size:
        return [0]
    # every tile full size; the last one overlaps its neighbour more
    return [*range(0, size - tile, stride), size - tile]


@dataclass(frozen=True)
class TileGrid:
    tile: int  # latent pixels per side
    h: int
    w: int
    lockstep: bool = True  # video: tiles advance together, chunk by chunk (else tile after tile)

    @property
    def stride(self) -> int:
        return self.tile - max(1, self.tile // OVERLAP_FRACTION)

    @property
    def ys(self) -> list[int]:
        return _starts(self.h, self.tile, self.stride)

    @property
    def xs(self) -> list[int]:
        return _starts(self.w, self.tile, self.stride)

    @property
    def tile_h(self) -> int:
        return min(self.tile, self.h)

    @property
    def tile_w(self) -> int:
        return min(self.tile, self.w)

    def tiles(self) -> list[tuple[int, int]]:
        return [(y, x) for y in self.ys for x in self.xs]

    def cut(self, z: torch.Tensor, y: int, x: int) -> torch.Tensor:
        return z[..., y : y + self.tile_h, x : x + self.tile_w]


def spread_grid(h: int, w: int, scale: int, pixels: int | None) -> TileGrid | None:
    """Tiles of about `pixels` output pixels each for an image of at least that many
    (`parallel.min_output_pixels`: spread across replicas); None: no such setting, or one tile."""
    if pixels is None or h * w * scale * scale < pixels:
        return None
    tile = max(MIN_TILE, math.isqrt(pixels) // scale)
    return TileGrid(tile, h, w) if tile < max(h, w) else None


def tile_for(model: TierPrice, items: int, frames: int, h: int, w: int, held_bytes: int, bound: int) -> TileGrid | None:
    """The largest tiles whose decode fits `bound` with `held_bytes` beside it, lockstep first
    (None: nothing fits). Images: a
    tile's need grows with its size, so a bisection finds it (a tier priced per shape runs its twin
    a few times, not once per size)."""
    scale_px = model.facts.scale**2
    clip_fp32 = items * frames * h * w * scale_px * 3 * 4  # tile after tile: the blended clip

    def fits(tile: int, lockstep: bool) -> bool:
        grid = TileGrid(tile, h, w, lockstep)
        one = model.working(items, grid.tile_h, grid.tile_w)
        others = (len(grid.tiles()) - 1) * model.resident(items, grid.tile_h, grid.tile_w)  # their history
        return one + (others if lockstep else clip_fp32) + held_bytes <= bound

    if not model.facts.video:
        if not fits(MIN_TILE, True):
            return None
        lo, hi = MIN_TILE, max(h, w)  # fits(lo); the answer is in lo..hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, True) else (lo, mid - 1)
        return TileGrid(lo, h, w)
    for lockstep in (True, False):
        for tile in range(max(h, w), MIN_TILE - 1, -1):
            if fits(tile, lockstep):
                return TileGrid(tile, h, w, lockstep)
    return None


def _ramp(starts: list[int], tile: int, size: int, scale: int) -> list[torch.Tensor]:
    """Per tile, its weight along one axis (output pixels): rising across the overlap with the tile
    before, falling across the overlap with the tile after, 1 elsewhere; normalised so the tiles'
    weights at every pixel sum to one. The 2-D weight of a tile is the product of its two axes'
    (which then sum to one as well), formed per tile as it is added: the blend holds no weight map
    of the whole output."""
    length = min(tile, size) * scale
    weights = []
    for i, start in enumerate(starts):
        w = torch.ones(length, dtype=torch.float64)
        if i > 0:
            overlap = (starts[i - 1] + tile - start) * scale
            w[:overlap] = torch.arange(1, overlap + 1, dtype=torch.float64) / (overlap + 1)
        if i + 1 < len(starts):
            overlap = (start + tile - starts[i + 1]) * scale
            w[length - overlap :] = torch.minimum(
                w[length - overlap :], torch.arange(overlap, 0, -1, dtype=torch.float64) / (overlap + 1)
            )
        weights.append(w)
    total = torch.zeros(size * scale, dtype=torch.float64)
    for start, w in zip(starts, weights, strict=True):
        total[start * scale : start * scale + length] += w
    return [(w / total[s * scale : s * scale + length]).float() for s, w in zip(starts, weights, strict=True)]


class Blender:
    """Adds weighted tile outputs into whole pictures ([..., H, W]) as they come, one accumulator
    per slot (per chunk when tiles run one after another)."""

    def __init__(self, grid: TileGrid, scale: int):
        self.grid, self.scale = grid, scale
        self.wy = dict(zip(grid.ys, _ramp(grid.ys, grid.tile, grid.h, scale), strict=True))
        self.wx = dict(zip(grid.xs, _ramp(grid.xs, grid.tile, grid.w, scale), strict=True))
        self.acc: dict[int, torch.Tensor] = {}
        self.device = torch.device("cpu")

    def _region(self, y: int, x: int) -> tuple[slice, slice]:
        s, g = self.scale, self.grid
        return slice(y * s, (y + g.tile_h) * s), slice(x * s, (x + g.tile_w) * s)

    def add(self, key: tuple[int, int], out: torch.Tensor, slot: int = 0) -> None:
        if out.device != self.device:  # once per decode, not per tile and chunk
            self.wy = {k: w.to(out.device) for k, w in self.wy.items()}
            self.wx = {k: w.to(out.device) for k, w in self.wx.items()}
            self.device = out.device
        if slot not in self.acc:
            shape = (*out.shape[:-2], self.grid.h * self.scale, self.grid.w * self.scale)
            self.acc[slot] = torch.zeros(shape, dtype=torch.float32, device=out.device)
            self.dtype = out.dtype
        y, x = key
        weight = self.wy[y][:, None] * self.wx[x][None, :]
        self.acc[slot][(..., *self._region(y, x))].addcmul_(out.float(), weight)

    def take(self, slot: int = 0) -> torch.Tensor:
        return self.acc.pop(slot).to(self.dtype)


TileDecoder = Callable[[list[torch.Tensor]], Iterable[torch.Tensor]]  # tiles' latents -> their pixels, in order


def tiled_image(z: torch.Tensor, grid: TileGrid, scale: int, decode_tiles: TileDecoder) -> torch.Tensor:
    """`decode_tiles`: each tile's decoded pixels in the grid's order, one at a time as they are
    needed (here) or all decoded elsewhere at once (other replicas): the blend is the same."""
    blender = Blender(grid, scale)
    keys = grid.tiles()
    for key, out in zip(keys, decode_tiles([grid.cut(z, y, x) for y, x in keys]), strict=True):
        blender.add(key, out)
    return blender.take()


TileRuns = Callable[[list[torch.Tensor]], list[Iterator[torch.Tensor]]]  # tiles' latents -> their chunks each


class OnDevice:
    """A tile's chunks decoded elsewhere, each moved to `device` as it is read; `close` stops the
    decode there."""

    def __init__(self, run: Iterator[torch.Tensor], device: torch.device):
        self.run, self.device = run, device

    def __iter__(self) -> OnDevice:
        return self

    def __next__(self) -> torch.Tensor:
        return next(self.run).to(self.device)

    def close(self) -> None:
        close = getattr(self.run, "close", None)
        if close is not None:
            close()


def tiled_chunks(z: torch.Tensor, grid: TileGrid, scale: int, tile_runs: TileRuns) -> Iterator[torch.Tensor]:
    """One blended chunk per latent frame, the tiles in lockstep or one after another (grid).
    `tile_runs`: every tile's chunk iterator, made at once (lazy here; decoding elsewhere, already
    started), then read in the grid's order: in lockstep, chunk k of every tile before chunk k+1
    of any, so a chunk goes out once every tile's has arrived. However the decode ends (done,
    failed, abandoned), every tile's run is closed: a decode elsewhere stops with it."""
    blender = Blender(grid, scale)
    keys = grid.tiles()
    runs = dict(zip(keys, tile_runs([grid.cut(z, y, x) for y, x in keys]), strict=True))
    try:
        if not grid.lockstep:
            count = 0
            for key, run in runs.items():
                for count, out in enumerate(run, 1):
                    blender.add(key, out, count)
            for slot in range(1, count + 1):
                yield blender.take(slot)
            return
        while True:
            for key, run in runs.items():
                out = next(run, None)
                if out is None:
                    return
                blender.add(key, out)
            yield blender.take()
    finally:
        for run in runs.values():
            close = getattr(run, "close", None)
            if close is not None:
                close()
