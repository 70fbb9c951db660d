"""Spatially tiled decode for `high` requests over the memory bound: overlapping latent tiles, each
decoded on its own, blended with linear ramps across every overlap (the weights of the tiles
covering a pixel sum to one). Video keeps its temporal chunking, in one of two orders:

- lockstep: every tile runs its own chunk decoder (its own causal history) and all advance one
  latent frame at a time, so a tiled video still streams chunk by chunk; but every tile's history
  is held at once, and Wan's history is about half its peak (engine/pricing/memory.py), so this bounds
  memory only down to about that;
- tile after tile: one tile's history at a time, the blended clip held in fp32 until the last
  tile is done (frames are handed over only then). Chosen when lockstep cannot fit the bound.

The tiles see less context than the whole latent (convolution borders, and Wan's and SD's
attention mid-blocks are global), so tiled output differs from untiled; docs/performance.md gives the
error measured and the tests bound it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vae_service.engine.pricing.memory import TierPrice
from vae_service.engine.runtime.tile_jobs import TILE_WINDOW, TierTile, TileOutput

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
    optional: bool = False  # fits whole: tiled only to share the tiles with other replicas
    ahead: int = TILE_WINDOW - 1  # images: finished tiles that may wait for the blend (shared: 0 = not worth it)

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


def sharing_grid(h: int, w: int, scale: int, pixels: int | None) -> TileGrid | None:
    """Tiles of about `pixels` output pixels each for an image of at least that many, to share with
    other replicas while they are idle (`parallel.min_output_pixels`; optional: decoded whole where
    no replica takes a tile); None: no such setting, or one tile."""
    if pixels is None or h * w * scale * scale < pixels:
        return None
    tile = max(MIN_TILE, math.isqrt(pixels) // scale)
    return TileGrid(tile, h, w, optional=True) if tile < max(h, w) else None


def grid_price(model: TierPrice, items: int, frames: int, grid: TileGrid, held_bytes: int) -> tuple[int, int]:
    """(peak, held between two tiles) of decoding on `grid` with `held_bytes` beside it: one tile's
    working set, and what stays meanwhile: video, the other tiles' histories (lockstep) or the
    blended clip (tile after tile); images, the tiles finished ahead of the blend."""
    one = model.working(items, grid.tile_h, grid.tile_w)
    if model.facts.video:
        if grid.lockstep:
            rest = (len(grid.tiles()) - 1) * model.resident(items, grid.tile_h, grid.tile_w)  # their history
        else:
            rest = items * frames * grid.h * grid.w * model.facts.scale**2 * 3 * 4  # the blended clip, fp32
    else:
        rest = grid.ahead * items * grid.tile_h * grid.tile_w * model.facts.scale**2 * 3 * 4  # fp32 at most
    return one + rest + held_bytes, rest + held_bytes


def tile_for(model: TierPrice, items: int, frames: int, h: int, w: int, held_bytes: int, bound: int) -> TileGrid | None:
    """The largest tiles whose decode fits `bound` with `held_bytes` beside it, lockstep first
    (None: nothing fits). Images: beside the tiles finished ahead of the blend where they are
    shared (engine/execution/tile_executor.py's window: `TILE_WINDOW - 1`, fewer where even the smallest
    tiles leave less room, none then meaning they stay here); a tile's need grows with its size,
    so a bisection finds it (a tier priced per shape runs its twin a few times, not once per size)."""

    def need(tile: int, lockstep: bool, ahead: int = 0) -> int:
        return grid_price(model, items, frames, TileGrid(tile, h, w, lockstep, ahead=ahead), held_bytes)[0]

    if not model.facts.video:
        for ahead in range(TILE_WINDOW - 1, -1, -1):
            if need(MIN_TILE, True, ahead) > bound:
                continue
            lo, hi = MIN_TILE, max(h, w)  # need(lo) fits; the answer is in lo..hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid, True, ahead) <= bound else (lo, mid - 1)
            return TileGrid(lo, h, w, ahead=ahead)
        return None
    for lockstep in (True, False):
        for tile in range(max(h, w), MIN_TILE - 1, -1):
            if need(tile, lockstep) <= bound:
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


def tier_tiles(z: torch.Tensor, grid: TileGrid, quality: str, timestep: float | None) -> list[TierTile]:
    """The grid's tiles of `z` as jobs, in the grid's order (rows, then columns)."""
    return [TierTile(grid.cut(z, y, x), quality, timestep) for y, x in grid.tiles()]


def blended(grid: TileGrid, scale: int, outputs: Iterator[TileOutput], lockstep: bool = True) -> Iterator[torch.Tensor]:
    """The one place tiles are blended: `outputs` in blend order (engine/execution/tile_executor.py), here or
    from other replicas alike. Lockstep (images: their one step): each step's blended output once
    every tile's part of it arrived; tile after tile: every chunk's at the end. However the reading
    ends, `outputs` is closed (tiles still decoding elsewhere are cancelled)."""
    blender, keys = Blender(grid, scale), grid.tiles()
    last, counts = len(keys) - 1, [0] * len(keys)
    try:
        for out in outputs:
            counts[out.job] += 1
            blender.add(keys[out.job], out.pixels, 0 if lockstep else counts[out.job])
            if lockstep and out.job == last:
                yield blender.take()
        for slot in range(1, 0 if lockstep else counts[0] + 1):
            yield blender.take(slot)
    finally:
        close = getattr(outputs, "close", None)
        if close is not None:
            close()
