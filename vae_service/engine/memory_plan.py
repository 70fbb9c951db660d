"""Per request, before it is queued: its estimated peak decode memory (engine/memory.py) against
the bound, and what follows: decode whole, decode `high` in tiles (engine/tiling.py), `lossless`
by the model class's own tiled decode, or refuse; and the request's own `tiling` (plan_tiling)."""

from __future__ import annotations

from vae_service.config import Limits
from vae_service.engine.errors import InvalidInput, LimitExceeded
from vae_service.engine.latents import PreparedRequest
from vae_service.engine.memory import TierMemory
from vae_service.engine.memory_budget import MemoryBudget
from vae_service.engine.tiling import DIFFUSERS_TILES, DiffusersTiles, TileGrid, tile_for


def decode_bound(limits: Limits, budget: MemoryBudget) -> int:
    """limits.max_decode_bytes, or the engine's fixed default (engine/memory_budget.py)."""
    return limits.max_decode_bytes if limits.max_decode_bytes is not None else budget.default_bound


def _output_pixels(prepared: PreparedRequest, model: TierMemory, frames: int = 1) -> int:
    """Output pixels of `frames` frames of every item."""
    h, w = prepared.latents.shape[-2:]
    return prepared.items * frames * h * w * model.scale**2


def answer_bytes(prepared: PreparedRequest, model: TierMemory) -> int:
    """What the answer holds while it is decoded (nothing for a streamed request)."""
    if prepared.request.stream:
        return 0
    return model.answer(_output_pixels(prepared, model, prepared.frames), prepared.request.output)


def _chunk_pixels(prepared: PreparedRequest, model: TierMemory) -> int:
    """Output pixels of the largest chunk a video decode hands over at once."""
    chunk_frames = prepared.frames if model.per_latent_frame else min(prepared.frames, model.chunk_frames)
    return _output_pixels(prepared, model, chunk_frames)


def held_beside_the_decode(prepared: PreparedRequest, model: TierMemory) -> int:
    """Video: the frames kept so far, and the conversion of one chunk (its fp32 copy and uint8
    pixels), both held while the decode goes on."""
    converting = 0 if prepared.request.output == "float" else _chunk_pixels(prepared, model) * (12 + 3)
    return answer_bytes(prepared, model) + converting


def held_while_tiled(prepared: PreparedRequest, model: TierMemory) -> int:
    """Beside one tile's decode: the blend's fp32 accumulator (video in lockstep: one chunk's;
    tile after tile's whole clip is counted by tile_for) and what the answer holds."""
    if model.video:
        return held_beside_the_decode(prepared, model) + _chunk_pixels(prepared, model) * 12
    return answer_bytes(prepared, model) + _output_pixels(prepared, model) * 12


def peak_bytes(prepared: PreparedRequest, model: TierMemory) -> int:
    """Estimated peak of decoding this request whole. Video converts and keeps frames while the
    decode goes on; an image is decoded, then converted (its decoded pixels are in both phases),
    and `lossless` decodes its items one by one, keeps them, then joins them."""
    h, w = prepared.latents.shape[-2:]
    items, high = prepared.items, prepared.request.quality == "high"
    working = model.working(items if high else 1, h, w, prepared.latent_frames)
    answer = answer_bytes(prepared, model)
    if model.video:
        return working + held_beside_the_decode(prepared, model)
    if high:
        return max(working, answer)
    decoded_item = _output_pixels(prepared, model) // items * 3 * model.itemsize
    return max(working + (items - 1) * decoded_item, 2 * items * decoded_item, answer)


def plan_memory(
    prepared: PreparedRequest,
    model: TierMemory,
    bound: int,
    force: bool = False,
    diffusers_tiled: TierMemory | None = None,
) -> TileGrid | DiffusersTiles | None:
    """None: decode whole; else the tiles (`force`: tiles even within the bound). `lossless` above
    the bound decodes with the model's own tiled decode, priced by `diffusers_tiled` (None: the
    model has none)."""
    need = peak_bytes(prepared, model)
    if need <= bound and not force:
        return None
    gib = f"about {need / 2**30:.3g} GiB, over max_decode_bytes ({bound / 2**30:.3g} GiB)"
    if prepared.request.quality == "lossless":
        if diffusers_tiled is None:
            raise LimitExceeded(
                "latents",
                f"decoding these latents needs {gib}, and this model's class has no tiled decode of its own "
                "for 'lossless' above the bound: send quality 'high' (decoded in spatial tiles within the "
                "bound) or fewer items",
            )
        tiled_need = peak_bytes(prepared, diffusers_tiled)
        if tiled_need > bound:
            raise LimitExceeded(
                "latents",
                f"decoding these latents needs {gib}; even diffusers' tiled decode needs about "
                f"{tiled_need / 2**30:.3g} GiB: send quality 'high' or fewer items",
            )
        return DIFFUSERS_TILES
    h, w = prepared.latents.shape[-2:]
    grid = tile_for(model, prepared.items, prepared.frames, h, w, held_while_tiled(prepared, model), bound)
    if grid is None:
        raise LimitExceeded("latents", f"decoding these latents needs {gib}, and even tiled it does not fit")
    return grid


def plan_tiling(
    prepared: PreparedRequest, model: TierMemory, bound: int, diffusers_tiled: TierMemory | None = None
) -> TileGrid | DiffusersTiles | None:
    """plan_memory, as the request's `tiling` asks (engine/request.py's TILINGS): "auto" as the
    bound decides; "model" the class's own tiled decode whatever the bound (`vae.enable_tiling();
    vae.decode`: what a caller whose local VAE has tiling on gets), 400 where the class has none;
    "none" never tiled, 413 where the whole decode is over the bound (a caller without tiling
    would otherwise get tiled bits it did not ask for)."""
    tiling = prepared.request.tiling
    if tiling == "auto":
        return plan_memory(prepared, model, bound, diffusers_tiled=diffusers_tiled)
    if tiling == "model":
        if diffusers_tiled is None:
            raise InvalidInput(
                "tiling", "'model': this model's class has no tiled decode of its own; send 'auto' or 'none'"
            )
        need = peak_bytes(prepared, diffusers_tiled)
        if need > bound:
            raise LimitExceeded(
                "tiling",
                f"'model': even the class's tiled decode needs about {need / 2**30:.3g} GiB, over "
                f"max_decode_bytes ({bound / 2**30:.3g} GiB): send fewer items",
            )
        return DIFFUSERS_TILES
    need = peak_bytes(prepared, model)
    if need > bound:
        raise LimitExceeded(
            "tiling",
            f"'none': decoding these latents whole needs about {need / 2**30:.3g} GiB, over max_decode_bytes "
            f"({bound / 2**30:.3g} GiB): send tiling 'auto' (or 'model' for the class's own tiled decode) or "
            "fewer items",
        )
    return None
