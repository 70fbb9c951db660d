"""Turn validated wire params into decoder input: check against the model, unpack, cast, unscale.

The arithmetic mirrors diffusers' pipelines exactly (SD/FLUX: `z / scaling + shift`; Wan:
`z / (1 / std) + mean`) so that a lossless decode is bit-identical to theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vae_service.config import Limits
from vae_service.errors import PayloadTooLarge, RequestError
from vae_service.models.spec import ModelSpec
from vae_service.protocol.decode_schema import UNSET, DecodeParams


@dataclass(frozen=True)
class PreparedRequest:
    latents: torch.Tensor  # [B, C, H, W] or [B, C, T, H, W], decode dtype, on the engine's device
    quality: str
    output: str
    request_id: str | None

    @property
    def items(self) -> int:
        return self.latents.shape[0]

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys may share one decoder call; nothing else may."""
        return (self.quality, tuple(self.latents.shape[1:]), self.latents.dtype)


def _unpack_packed(z: torch.Tensor, params: DecodeParams, spec: ModelSpec) -> torch.Tensor:
    """FLUX-style packed latents [B, L, C*4] -> [B, C, h, w] (2x2 patches), as FluxPipeline does."""
    if params.height is None or params.width is None:
        missing = "height" if params.height is None else "width"
        raise RequestError(missing, "is required for packed latents [B, L, C*4]")
    b, length, packed_c = z.shape
    if packed_c != spec.latent_channels * 4:
        raise RequestError(
            "latents", f"packed latents need last dim {spec.latent_channels * 4} (4 x {spec.latent_channels} "
            f"channels) for model '{spec.name}', got shape {list(z.shape)}",
        )
    h = 2 * (params.height // (spec.spatial_scale * 2))
    w = 2 * (params.width // (spec.spatial_scale * 2))
    if h == 0 or w == 0 or length != (h // 2) * (w // 2):
        raise RequestError(
            "latents", f"{length} packed tokens do not match height={params.height}, width={params.width} "
            f"(expected {(h // 2) * (w // 2)})",
        )
    z = z.view(b, h // 2, w // 2, spec.latent_channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return z.reshape(b, spec.latent_channels, h, w)


def _to_decoder_layout(z: torch.Tensor, params: DecodeParams, spec: ModelSpec) -> torch.Tensor:
    if spec.family == "image":
        if z.dim() == 3:
            return _unpack_packed(z, params, spec)
        expected = f"[B, {spec.latent_channels}, H, W] or packed [B, L, {spec.latent_channels * 4}]"
        ok_rank = z.dim() == 4
    else:
        if z.dim() == 4:  # a single-frame video given as an image latent
            z = z.unsqueeze(2)
        expected = f"[B, {spec.latent_channels}, T, H, W] or [B, {spec.latent_channels}, H, W]"
        ok_rank = z.dim() == 5
    if not ok_rank or z.shape[1] != spec.latent_channels:
        raise RequestError("latents", f"model '{spec.name}' takes {expected}, got shape {list(z.shape)}")
    return z


def _check_output(params: DecodeParams, spec: ModelSpec, frames: int) -> None:
    if params.output == "mp4" and spec.family != "video":
        raise RequestError("output", f"'mp4' is for video models; model '{spec.name}' decodes images")
    if params.output in ("png", "jpeg") and frames > 1:
        raise RequestError(
            "output", f"'{params.output}' encodes single images but these latents decode to {frames} frames; "
            "use 'mp4', 'uint8' or 'float'",
        )


def _check_budget(z: torch.Tensor, spec: ModelSpec, limits: Limits) -> int:
    if z.shape[0] > limits.max_batch_items:
        raise PayloadTooLarge(
            "latents", f"batch of {z.shape[0]} is over the limit of {limits.max_batch_items} (max_batch_items)"
        )
    frames = spec.output_frames(z.shape[2]) if z.dim() == 5 else 1
    pixels = z.shape[0] * frames * z.shape[-2] * z.shape[-1] * spec.spatial_scale**2
    if pixels > limits.max_output_pixels:
        raise PayloadTooLarge(
            "latents", f"decodes to {pixels} pixels, over the limit of {limits.max_output_pixels} (max_output_pixels)"
        )
    return frames


def unscale(z: torch.Tensor, params: DecodeParams, spec: ModelSpec) -> torch.Tensor:
    scaling = spec.scaling_factor if params.scaling_factor is UNSET else params.scaling_factor
    shift = spec.shift_factor if params.shift_factor is UNSET else params.shift_factor
    if params.scaling_factor is UNSET and spec.latents_std is not None:
        view = (1, spec.latent_channels) + (1,) * (z.dim() - 2)
        mean = torch.tensor(spec.latents_mean).view(view).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(spec.latents_std).view(view).to(z.device, z.dtype)
        return z / inv_std + mean
    if scaling is not None:
        z = z / scaling
    if shift is not None:
        z = z + shift
    return z


def prepare(
    params: DecodeParams, spec: ModelSpec, device: torch.device, dtype: torch.dtype, limits: Limits
) -> PreparedRequest:
    z = _to_decoder_layout(params.latents, params, spec)
    frames = _check_budget(z, spec, limits)
    _check_output(params, spec, frames)
    z = unscale(z.to(device=device, dtype=dtype), params, spec).contiguous()
    return PreparedRequest(z, params.quality, params.output, params.request_id)
