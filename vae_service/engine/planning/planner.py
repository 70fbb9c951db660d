"""Deciding, before any tensor moves: how one request is decoded within the memory bound (whole, in
spatial tiles, or by the class's own tiled decode; else 413), how a batch of requests that share a
key is run (which decode together, which alone), and which tile executor each run's tiles go to
(engine/execution/tile_executor.py: here, or shared with the deployment's replicas: remote means lockstep).
The executor (engine/execution/executor.py) does what the plan says; nothing here decodes.

Tiers:
- `preview`: one run for the whole batch (the preview's map is per pixel, never tiled), priced like a
  decode (its map's working set, engine/runtime/preview.py): over the bound it is refused;
- `lossless`: one run per request, every item alone (bit-identity with `vae.decode` of that item);
  above the bound, the class's own tiled decode of every item (`ClassTiles`);
- `high`: one run for the whole batch when nothing is tiled and the batch fits the bound together,
  else one run per request with its items together, tiled by its grid (`TileGrid`). A grid that is
  only there to share a large request (`optional`, `parallel.min_output_pixels`) is dropped where
  nothing is shared.

The fp32 fallback of fp16/bf16 engines (engine/execution/fallback.py) is a decode too, planned here
like any other (`plan_fallback`): an item that overflows is decoded again as the fp32 deployment
with the same bound decodes it as `lossless` (whole, or by the class's own tiled decode), and a
request is admitted only when that plan fits the bound as well as its own.
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
    tiling would otherwise get tiled bits it did not ask for). With the fp32 fallback on, refused
    too where the fallback's plan for it does not fit `bound` (`plan_fallback`)."""
    tiling = _plan(prepared, cost, bound, share_pixels)
    plan_fallback(prepared, cost, bound)
    return tiling


def _plan(prepared: PreparedRequest, cost: CostModel, bound: int, share_pixels: int | None) -> Tiling:
    quality, tiling = prepared.request.quality, prepared.request.tiling
    if tiling == "model" and quality != "preview":
        return _class_tiles(prepared, cost, bound, "tiling", "'model': ", "send fewer items")
    need = cost.peak(prepared)
    if quality == "preview":  # never tiled
        if need > bound:
            raise LimitExceeded(
                "latents",
                f"a preview of these latents needs about {need / 2**30:.3g} GiB, over max_decode_bytes "
                f"({bound / 2**30:.3g} GiB), and a preview is never tiled: send fewer items or frames",
            )
        return None
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


FALLBACK_WHY = (
    "with precision_fallback on, an item whose output overflows this precision is decoded again in fp32 "
    "(as the fp32 deployment decodes it as 'lossless')"
)


def plan_fallback(prepared: PreparedRequest, cost: CostModel, bound: int) -> Tiling:
    """The fp32 fallback's plan for `prepared`'s items that overflow: what the fp32 deployment with
    the same `bound` plans for the request as `lossless` (`_plan` at fp32: whole where it fits, else
    the class's own tiled decode; 'model' that decode whatever the bound, 'none' never tiled), so
    that an item that falls back is that deployment's answer, bits and `tiled` alike. Refused
    (LimitExceeded naming the field `_plan` would) where it does not fit `bound`, beside what the
    answer holds meanwhile (CostModel.fallback_peak). None (whole) where nothing falls back:
    `preview`, fp32 engines, the fallback off."""
    fp32 = cost.fallback
    if fp32 is None or prepared.request.quality == "preview":
        return None
    tiling, need = prepared.request.tiling, fp32.peak(prepared, "lossless")
    gib = f"about {need / 2**30:.3g} GiB, over max_decode_bytes ({bound / 2**30:.3g} GiB)"
    if tiling == "model":
        plan = _class_tiles(prepared, fp32, bound, "tiling", f"'model': {FALLBACK_WHY}, and ", "send fewer items")
    elif need <= bound:
        plan = None
    elif tiling == "none":
        raise LimitExceeded(
            "tiling", f"'none': {FALLBACK_WHY}, which whole needs {gib}: send tiling 'auto' or fewer items"
        )
    elif not fp32.has_class_tiled:
        raise LimitExceeded(
            "latents",
            f"{FALLBACK_WHY}, which needs {gib}, and this model's class has no tiled decode of its own: send "
            "fewer items",
        )
    else:
        plan = _class_tiles(
            prepared, fp32, bound, "latents", f"{FALLBACK_WHY}, which needs {gib}; ", "send fewer items"
        )
    held = cost.fallback_peak(prepared, plan is not None)
    if held > bound:  # what the fp32 plan holds, and the answer's frames at this precision beside it
        raise LimitExceeded(
            "latents",
            f"{FALLBACK_WHY}, which with the answer's frames held needs about {held / 2**30:.3g} GiB, over "
            f"max_decode_bytes ({bound / 2**30:.3g} GiB): send output 'uint8' or fewer items",
        )
    return plan


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
    # per request of the batch: the fp32 fallback's plan for its items that overflow (plan_fallback);
    # empty where nothing falls back
    fallbacks: tuple[Tiling, ...] = ()

    @property
    def tiled(self) -> bool:
        return any(run.tiling is not None for run in self.runs)

    def fallback_tiled(self, i: int) -> bool:
        """Whether request i's items that overflow are decoded again by the class's own tiled decode
        (else whole)."""
        return bool(self.fallbacks) and isinstance(self.fallbacks[i], ClassTiles)


def plan_batch(batch: list[PreparedRequest], cost: CostModel, bound: int, shared: bool = False) -> BatchPlan:
    """The batch's runs, each request with the tiling its prepare planned; `shared`: the call has the
    deployment's replicas to share tiles with."""
    keys = {r.batch_key for r in batch}
    if len(keys) != 1:
        raise ValueError(f"a batch must share one (tier, shape, dtype) key, got {sorted(map(str, keys))}")
    quality = batch[0].request.quality
    tilings = [_kept(r.tiling, shared) for r in batch]
    fallbacks = _fallbacks(batch, cost, bound)
    everyone = tuple(range(len(batch)))
    if quality == "preview":
        runs = (Run(everyone, together=True),)
    elif quality == "lossless":
        runs = tuple(
            Run((i,), False, t, _shares(t, shared) and _room_to_share(r, t, cost, bound))
            for i, (r, t) in enumerate(zip(batch, tilings, strict=True))
        )
    elif tilings[0] is None and (len(batch) == 1 or _fit_together(batch, fallbacks, cost, bound)):
        runs = (Run(everyone, together=True),)
    else:
        runs = tuple(Run((i,), True, t, _shares(t, shared)) for i, t in enumerate(tilings))
    return BatchPlan(quality, runs, fallbacks)


def _fallbacks(batch: list[PreparedRequest], cost: CostModel, bound: int) -> tuple[Tiling, ...]:
    """Each request's fallback plan, within the bound it was admitted under (its context's: the
    plan its admission checked), `bound` for a request without a context."""
    if cost.fallback is None or batch[0].request.quality == "preview":
        return ()
    return tuple(plan_fallback(r, cost, bound if r.context is None else cost.bound(r.context.limits)) for r in batch)


def _fit_together(batch: list[PreparedRequest], fallbacks: tuple[Tiling, ...], cost: CostModel, bound: int) -> bool:
    """Whether `high` requests decode within `bound` together: their decode, and, with the fallback
    on, any one of them falling back while all of them hold their decoded pixels and answers."""
    if sum(cost.peak(r) for r in batch) > bound:
        return False
    if not fallbacks:
        return True
    held = sum(cost.held_after_decode(r) for r in batch)
    return held + max(cost.fallback_peak(r, t is not None) for r, t in zip(batch, fallbacks, strict=True)) <= bound


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


def _room_to_share(prepared: PreparedRequest, tiling: Tiling, cost: CostModel, bound: int) -> bool:
    """A class's tiled decode goes to replicas only where the bound also holds what sharing holds
    here (outputs replicas finished ahead of the blend); else its decoder calls all run here."""
    return not isinstance(tiling, ClassTiles) or cost.class_tiled_peak(prepared, shared=True) <= bound


def retry_plan(batch: list[PreparedRequest], cost: CostModel, shared: bool = False) -> BatchPlan:
    """The out-of-memory retry's plan: every request in `high` tiles planned for half its estimated
    peak (a real device held more than the estimate said), through the same tile executors; its
    fallbacks as planned at admission."""
    runs = []
    for i, request in enumerate(batch):
        grid = tiles_within(request, cost, cost.peak(request) // 2)
        if grid is None:
            raise LimitExceeded("latents", "out of device memory, and even tiled small it does not fit")
        runs.append(Run((i,), True, grid, _shares(grid, shared)))
    return BatchPlan(batch[0].request.quality, tuple(runs), _fallbacks(batch, cost, cost.budget.default_bound))
