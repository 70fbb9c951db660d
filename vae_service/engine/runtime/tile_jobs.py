"""What one tile of a request is: a typed job saying what to decode, which any replica with the
request's fingerprint decodes to the same bits (engine/runtime/fingerprint.py). The executors
(engine/execution/tile_executor.py) run jobs here or on other replicas; `Runtime.run_job` is the one place a
job becomes pixels.

- `TierTile`: a spatial tile of a request's latents, decoded as its tier decodes (`high` tiles over
  the memory bound, or shared with idle replicas); an image tile gives one output, a video tile one chunk per latent
  frame on its own causal history.
- `DecoderInput`: one input of the class's own tiled decode's decoder (`lossless` above the bound,
  models/diffusers_tiling.py), one output.
- `CausalTile`: one tile of a cached causal decoder's own tiled decode (Wan, Qwen-Image): every
  latent frame of the tile on a fresh cache, one output with all its frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE_WINDOW = 8  # jobs from the blend's to the furthest decoding: at most this many held or out


@dataclass(frozen=True)
class TierTile:
    latents: torch.Tensor  # [B, C, (T,) h, w]: the decoder input of the tile
    quality: str  # the tier that decodes it
    timestep: float | None = None  # timestep-conditioned decoders


@dataclass(frozen=True)
class DecoderInput:
    latents: torch.Tensor


@dataclass(frozen=True)
class CausalTile:
    latents: torch.Tensor  # [B, C, T, h, w]


TileJob = TierTile | DecoderInput | CausalTile


def gives_chunks(job: TileJob, chunked: bool) -> bool:
    """Whether the job's output comes as several chunks (a video tile of a tier, one per latent
    frame), rather than one tensor."""
    return isinstance(job, TierTile) and chunked


def on_host(job: TileJob) -> TileJob:
    """`job` with its latents on the host in storage of their own, to send to another replica (a
    view would carry its whole latent along)."""
    z = job.latents.cpu()
    own = z.is_contiguous() and z.untyped_storage().nbytes() == z.numel() * z.element_size()
    fields = {**job.__dict__, "latents": z if own else z.clone()}
    return type(job)(**fields)


@dataclass(frozen=True)
class TileOutput:
    job: int  # the job's index in the run
    pixels: torch.Tensor  # on this device
