"""From a DecodeRequest to decoder input, in two steps:

- `prepare` (cheap, before queueing): check the latents against the model and the limits, unpack
  packed latents (a view), and compute the batch key;
- `to_decoder_input` (on the device thread): move, cast, unscale.

The arithmetic mirrors diffusers' pipelines exactly (SD/FLUX: `z / scaling + shift`; Wan:
`z / (1 / std) + mean`, in the decode dtype) so that a lossless decode is bit-identical to theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vae_service.config import Limits
from vae_service.engine.errors import InvalidInput, LimitExceeded
from vae_service.engine.request import MODEL_DEFAULT, DecodeRequest
from vae_service.models.spec import ModelSpec


class BatchKey(NamedTuple):
    """Requests with equal keys may share one decoder call; nothing else may."""

    quality: str
    latent_shape: tuple[int, ...]  # without the batch dim, in decoder layout
    dtype: torch.dtype  # of the latents as sent
    tile: object  # the tiles of a tiled decode (engine.tiling.TileGrid; None: whole)


@dataclass(frozen=True)
class PreparedRequest:
    request: DecodeRequest
    latents: torch.Tensor  # [B, C, H, W] or [B, C, T, H, W], as sent (not yet cast or moved)
    frames: int  # output frames per item (1 for images)
    sink: Callable | None = None  # streaming: gets each chunk's frames (engine.video.FrameChunk) at once
    tile: object = None  # set by the engine's memory plan: the tiles (engine.tiling.TileGrid) or None

    @property
    def items(self) -> int:
        return self.latents.shape[0]

    @property
    def batch_key(self) -> BatchKey:
        return BatchKey(self.request.quality, tuple(self.latents.shape[1:]), self.latents.dtype, self.tile)


def _unpack_packed(z: torch.Tensor, request: DecodeRequest, spec: ModelSpec) -> torch.Tensor:
    """FLUX-style packed latents [B, L, C*4] -> [B, C, h, w] (2x2 patches), as FluxPipeline does."""
    if request.height is None or request.width is None:
        raise InvalidInput(
            "height" if request.height is None else "width", "is required for packed latents [B, L, C*4]"
        )
    b, length, packed_c = z.shape
    if packed_c != spec.latent_channels * 4:
        raise InvalidInput(
            "latents",
            f"packed latents need last dim {spec.latent_channels * 4} (4 x "
            f"{spec.latent_channels} channels) for model '{spec.name}', got shape {list(z.shape)}",
        )
    h = 2 * (request.height // (spec.spatial_scale * 2))
    w = 2 * (request.width // (spec.spatial_scale * 2))
    if h == 0 or w == 0 or length != (h // 2) * (w // 2):
        raise InvalidInput(
            "latents",
            f"{length} packed tokens do not match height={request.height}, "
            f"width={request.width} (expected {(h // 2) * (w // 2)})",
        )
    z = z.view(b, h // 2, w // 2, spec.latent_channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return z.reshape(b, spec.latent_channels, h, w)


def _to_decoder_layout(request: DecodeRequest, spec: ModelSpec) -> torch.Tensor:
    z = request.latents
    if spec.family == "image":
        if z.dim() == 3:
            return _unpack_packed(z, request, spec)
        expected = f"[B, {spec.latent_channels}, H, W] or packed [B, L, {spec.latent_channels * 4}]"
        ok_rank = z.dim() == 4
    else:
        if z.dim() == 4:  # a single-frame video given as an image latent
            z = z.unsqueeze(2)
        expected = f"[B, {spec.latent_channels}, T, H, W] or [B, {spec.latent_channels}, H, W]"
        ok_rank = z.dim() == 5
    if not ok_rank or z.shape[1] != spec.latent_channels:
        raise InvalidInput("latents", f"model '{spec.name}' takes {expected}, got shape {list(request.latents.shape)}")
    return z


def _check_budget(z: torch.Tensor, spec: ModelSpec, limits: Limits, flops_per_pixel: float) -> int:
    if z.shape[0] > limits.max_batch_items:
        raise LimitExceeded(
            "latents", f"batch of {z.shape[0]} is over the limit of {limits.max_batch_items} (max_batch_items)"
        )
    frames = spec.output_frames(z.shape[2]) if z.dim() == 5 else 1
    if frames > limits.max_frames:
        raise LimitExceeded(
            "latents", f"decodes to {frames} frames per item, over the limit of {limits.max_frames} (max_frames)"
        )
    pixels = z.shape[0] * frames * z.shape[-2] * z.shape[-1] * spec.spatial_scale**2
    if pixels > limits.max_output_pixels:
        raise LimitExceeded(
            "latents", f"decodes to {pixels} pixels, over the limit of {limits.max_output_pixels} (max_output_pixels)"
        )
    tflop = pixels * flops_per_pixel / 1e12
    if tflop > limits.max_decode_tflop:
        raise LimitExceeded(
            "latents",
            f"would cost about {tflop:.3g} TFLOP to decode, over the limit of "
            f"{limits.max_decode_tflop:g} (max_decode_tflop)",
        )
    return frames


# What the encoders can write, checked before any decode (PIL refuses wider JPEGs; x264 with
# yuv420p needs even sides, which an 8x VAE always gives).
MAX_JPEG_SIDE = 65_500


def _check_output(request: DecodeRequest, spec: ModelSpec, frames: int, z: torch.Tensor) -> None:
    if request.output == "mp4" and spec.family != "video":
        raise InvalidInput("output", f"'mp4' is for video models; model '{spec.name}' decodes images")
    height, width = z.shape[-2] * spec.spatial_scale, z.shape[-1] * spec.spatial_scale
    if request.output == "jpeg" and max(height, width) > MAX_JPEG_SIDE:
        raise InvalidInput(
            "output",
            f"'jpeg' holds at most {MAX_JPEG_SIDE} px per side; these latents decode to "
            f"{height}x{width}: use 'png', 'uint8' or 'float'",
        )
    if request.stream and (spec.family != "video" or request.output not in ("uint8", "float")):
        raise InvalidInput(
            "stream",
            "streams frames of video models as 'uint8' or 'float'; "
            + (f"model '{spec.name}' decodes images" if spec.family != "video" else f"not '{request.output}'"),
        )
    if request.output in ("png", "jpeg") and frames > 1:
        raise InvalidInput(
            "output",
            f"'{request.output}' encodes single images but these latents decode to "
            f"{frames} frames; use 'mp4', 'uint8' or 'float'",
        )


def _check_finite(z: torch.Tensor) -> None:
    finite = torch.isfinite(z)
    if not bool(finite.all()):
        raise InvalidInput("latents", f"contains {int((~finite).sum())} NaN or Inf values")


def prepare(request: DecodeRequest, spec: ModelSpec, limits: Limits, flops_per_pixel: float) -> PreparedRequest:
    if request.model is not None and request.model != spec.name:
        raise InvalidInput("model", f"unknown model {request.model!r}; served: ['{spec.name}']")
    z = _to_decoder_layout(request, spec)
    frames = _check_budget(z, spec, limits, flops_per_pixel)
    _check_output(request, spec, frames, z)
    _check_finite(z)
    return PreparedRequest(request, z, frames)


class LatentScaling:
    """The model's own latent factors, held on the device in the decode dtype (built once)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
        self.scaling, self.shift = spec.scaling_factor, spec.shift_factor
        self.mean = self.inv_std = None
        if spec.latents_std is not None:
            view = (1, spec.latent_channels, 1, 1, 1)
            self.mean = torch.tensor(spec.latents_mean).view(view).to(device, dtype)
            self.inv_std = 1.0 / torch.tensor(spec.latents_std).view(view).to(device, dtype)

    def unscale(self, z: torch.Tensor, request: DecodeRequest) -> torch.Tensor:
        if request.scaling_factor is MODEL_DEFAULT and self.inv_std is not None:  # video: z is 5-D
            return z / self.inv_std + self.mean
        scaling = self.scaling if request.scaling_factor is MODEL_DEFAULT else request.scaling_factor
        shift = self.shift if request.shift_factor is MODEL_DEFAULT else request.shift_factor
        if scaling is not None:
            z = z / scaling
        if shift is not None:
            z = z + shift
        return z


def to_decoder_input(
    prepared: PreparedRequest, scaling: LatentScaling, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    z = prepared.latents.to(device=device, dtype=dtype)
    return scaling.unscale(z, prepared.request).contiguous()
