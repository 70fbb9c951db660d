"""Deciding, before any tensor moves: how one request is decoded within the memory bound (whole, in
spatial tiles, or by the class's own tiled decode; else 413), how a batch of requests that share a
key is run (which decode together, which alone), and which tile executor each run's tiles go to
(engine/execution/tile_executor.py: here, or shared with the deployment's replicas: remote means lockstep).
The executor (engine/execution/executor.py) does what the plan says; nothing here decodes.

Tiers:
- `preview`: one run for the whole batch (the preview's map is per pixel, never tiled);
- `lossless`: one run per request, every item alone (bit-identity with `vae.decode` of that item);
  above the bound, the class's own tiled decode of every item (`ClassTiles`);
- `high`: one run for the whole batch when nothing is tiled and the batch fits the bound together,
  else one run per request with its items together, tiled by its grid (`TileGrid`). A grid that is
  only there to share a large request (`optional`, `parallel.min_output_pixels`) is dropped where
  nothing is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

from vae_service.engine.planning.tiling import TileGrid, sharing_grid, tile_for
from vae_service.engine.pricing.cost_model import CostModel
from vae_service.engine.request.errors import InvalidInput, LimitExceeded
from vae_service.engine.request.latents import PreparedRequest


@dataclass(frozen=True)
class ClassTiles:
    """`lossless` above the bound: the class's own tiled decode (`vae.enable_tiling()`, then
    `vae.decode`, with diffusers' default tile settings), bit-identical to what diffusers gives."""


Tiling = TileGrid | ClassTiles | None  # None: decoded whole


def plan_request(prepared: PreparedRequest, cost: CostModel, bound: int, share_pixels: int | None) -> Tiling:
    """How `prepared` decodes within `bound`: whole, tiled, or refused (LimitExceeded), as its
    `tiling` asks (engine/request/decode_request.py's TILINGS). "auto": as the bound decides, and a `high` request
    that fits whole is tiled anyway when it is large (`share_pixels`: tiles of about that many
    output pixels, for idle replicas to take). "model": the class's own tiled decode whatever the
    bound (what a caller whose local VAE has tiling on gets). "none": never tiled (a caller without
    tiling would otherwise get tiled bits it did not ask for)."""
    quality, tiling = prepared.request.quality, prepared.request.tiling
    if quality == "preview":
        return None
    if tiling == "model":
        return _class_tiles(prepared, cost, bound, "tiling", "'model': ", "send fewer items")
    need = cost.peak(prepared)
    if need <= bound:
        if quality == "high" and tiling == "auto":
            return sharing_grid(*prepared.latent_hw, cost.facts.scale, share_pixels)
        return None
    gib = f"about {need / 2**30:.3g} GiB, over max_decode_bytes ({bound / 2**30:.3g} GiB)"
    if tiling == "none":
        raise LimitExceeded(
            "tiling",
            f"'none': decoding these latents whole needs {gib}: send tiling 'auto' (or 'model' for the "
            "class's own tiled decode) or fewer items",
        )
    if quality == "lossless":
        if not cost.has_class_tiled:
            raise LimitExceeded(
                "latents",
                f"decoding these latents needs {gib}, and this model's class has no tiled decode of its own "
                "for 'lossless' above the bound: send quality 'high' (decoded in spatial tiles within the "
                "bound) or fewer items",
            )
        return _class_tiles(
            prepared,
            cost,
            bound,
            "latents",
            f"decoding these latents needs {gib}; ",
            "send quality 'high' or fewer items",
        )
    grid = tiles_within(prepared, cost, bound)
    if grid is None:
        raise LimitExceeded("latents", f"decoding these latents needs {gib}, and even tiled it does not fit")
    return grid


def _class_tiles(prepared: PreparedRequest, cost: CostModel, bound: int, field: str, why: str, instead: str):
    """The class's own tiled decode, if it has one and it fits `bound`; else refused naming `field`."""
    if not cost.has_class_tiled:
        raise InvalidInput(field, f"{why}this model's class has no tiled decode of its own; send 'auto' or 'none'")
    tiled_need = cost.class_tiled_peak(prepared)
    if tiled_need > bound:
        raise LimitExceeded(
            field,
            f"{why}even diffusers' tiled decode needs about {tiled_need / 2**30:.3g} GiB, over max_decode_bytes "
            f"({bound / 2**30:.3g} GiB): {instead}",
        )
    return ClassTiles()


def tiles_within(prepared: PreparedRequest, cost: CostModel, bound: int) -> TileGrid | None:
    """The largest `high` tiles whose decode fits `bound` beside what the request holds meanwhile."""
    h, w = prepared.latent_hw
    held = cost.held_while_tiled(prepared)
    return tile_for(cost.tiers["high"], prepared.items, prepared.frames, h, w, held, bound)


@dataclass(frozen=True)
class Run:
    members: tuple[int, ...]  # indices of the batch's requests decoded by this run, in order
    together: bool  # their items share one decoder call; else every item runs alone
    tiling: Tiling = None
    shared: bool = False  # its tiles may go to the deployment's replicas (lockstep; else decoded here)


@dataclass(frozen=True)
class BatchPlan:
    quality: str
    runs: tuple[Run, ...]

    @property
    def tiled(self) -> bool:
        return any(run.tiling is not None for run in self.runs)


def plan_batch(batch: list[PreparedRequest], cost: CostModel, bound: int, shared: bool = False) -> BatchPlan:
    """The batch's runs, each request with the tiling its prepare planned; `shared`: the call has the
    deployment's replicas to share tiles with."""
    keys = {r.batch_key for r in batch}
    if len(keys) != 1:
        raise ValueError(f"a batch must share one (tier, shape, dtype) key, got {sorted(map(str, keys))}")
    quality = batch[0].request.quality
    tilings = [_kept(r.tiling, shared) for r in batch]
    everyone = tuple(range(len(batch)))
    if quality == "preview":
        runs = (Run(everyone, together=True),)
    elif quality == "lossless":
        runs = tuple(Run((i,), False, t, _shares(t, shared)) for i, t in enumerate(tilings))
    elif tilings[0] is None and (len(batch) == 1 or sum(cost.peak(r) for r in batch) <= bound):
        runs = (Run(everyone, together=True),)
    else:
        runs = tuple(Run((i,), True, t, _shares(t, shared)) for i, t in enumerate(tilings))
    return BatchPlan(quality, runs)


def _kept(tiling: Tiling, shared: bool) -> Tiling:
    """An optional grid is worth its tiles only where they can be shared."""
    return None if isinstance(tiling, TileGrid) and tiling.optional and not shared else tiling


def _shares(tiling: Tiling, shared: bool) -> bool:
    """Whether a run's tiles go to the shared executor: tile after tile stays here (the clip's
    blend held whole while one tile's history at a time is), and so do image tiles where the
    bound leaves no room for a finished tile to wait for the blend; remote means lockstep."""
    if isinstance(tiling, TileGrid):
        return shared and tiling.lockstep and tiling.ahead > 0
    return shared and isinstance(tiling, ClassTiles)


def retry_plan(batch: list[PreparedRequest], cost: CostModel, shared: bool = False) -> BatchPlan:
    """The out-of-memory retry's plan: every request in `high` tiles planned for half its estimated
    peak (a real device held more than the estimate said), through the same tile executors."""
    runs = []
    for i, request in enumerate(batch):
        grid = tiles_within(request, cost, cost.peak(request) // 2)
        if grid is None:
            raise LimitExceeded("latents", "out of device memory, and even tiled small it does not fit")
        runs.append(Run((i,), True, grid, _shares(grid, shared)))
    return BatchPlan(batch[0].request.quality, tuple(runs))
