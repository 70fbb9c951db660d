"""Per request, before it is queued: its estimated peak decode memory (engine/memory.py) against
the bound, and what follows: decode whole, decode `high` in tiles (engine/tiling.py), or refuse
(`lossless` never tiles)."""

from __future__ import annotations

import os

import torch

from vae_service.config import Limits
from vae_service.engine.errors import LimitExceeded
from vae_service.engine.latents import PreparedRequest
from vae_service.engine.memory import MemoryModel
from vae_service.engine.tiling import TileGrid, tile_for


def decode_bound(limits: Limits, device: torch.device) -> int:
    """limits.max_decode_bytes, or by default 80% of the GPU's memory less what is allocated (the
    weights), or half the RAM."""
    if limits.max_decode_bytes is not None:
        return limits.max_decode_bytes
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(0.8 * total) - torch.cuda.memory_allocated(device)
    return int(0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def answer_bytes(prepared: PreparedRequest, model: MemoryModel) -> int:
    """What the answer holds while it is decoded (nothing for a streamed request)."""
    if prepared.request.stream:
        return 0
    h, w = prepared.latents.shape[-2:]
    pixels = prepared.items * prepared.frames * h * w * model.scale**2
    return model.answer(pixels, prepared.request.output)


def peak_bytes(prepared: PreparedRequest, model: MemoryModel) -> int:
    """Estimated peak of decoding this request whole (`lossless` decodes its items one by one)."""
    h, w = prepared.latents.shape[-2:]
    together = prepared.items if prepared.request.quality == "high" else 1
    return model.working(together, h, w, prepared.latent_frames) + answer_bytes(prepared, model)


def plan_memory(prepared: PreparedRequest, model: MemoryModel, bound: int, force: bool = False) -> TileGrid | None:
    """None: decode whole; else the tiles (`force`: tiles even within the bound)."""
    need = peak_bytes(prepared, model)
    if need <= bound and not force:
        return None
    gib = f"about {need / 2**30:.3g} GiB, over max_decode_bytes ({bound / 2**30:.3g} GiB)"
    if prepared.request.quality == "lossless":
        raise LimitExceeded(
            "latents",
            f"decoding these latents needs {gib}; 'lossless' never tiles: send quality 'high' "
            "(decoded in spatial tiles within the bound) or fewer items",
        )
    h, w = prepared.latents.shape[-2:]
    grid = tile_for(model, prepared.items, prepared.frames, h, w, answer_bytes(prepared, model), bound)
    if grid is None:
        raise LimitExceeded("latents", f"decoding these latents needs {gib}, and even tiled it does not fit")
    return grid
