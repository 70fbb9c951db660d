"""The latent forms denoisers hand over, brought into the decoder's layout (views or one small
copy of the latents; no arithmetic, so no bits change):

- decoder layout: [B, C, H, W] for image decoders, [B, C, T, H, W] for video decoders ([B, C, H, W]
  there is one frame);
- packed token sequences [B, L, C * p * p] with `height`/`width` in pixels (FLUX.1, FLUX.2 and
  Qwen-Image with 2x2 patches; Qwen-Image 2.1 with none): tokens in row-major order, each token's
  channels c * p * p + dy * p + dx, as the pipelines' `_pack_latents` write them;
- 2x2-patchified [B, 4C, h, w] (FLUX.2's denoiser space): channel c * 4 + dy * 2 + dx holds
  pixel (2y + dy, 2x + dx).
"""

from __future__ import annotations

from typing import Literal

import torch

from vae_service.engine.request.decode_request import DecodeRequest
from vae_service.engine.request.errors import InvalidInput
from vae_service.models.spec import ModelSpec

Form = Literal["decoder", "packed", "patchified"]


def _unpack(z: torch.Tensor, request: DecodeRequest, spec: ModelSpec) -> torch.Tensor:
    p, c = spec.entry.packed_patch, spec.latent_channels
    if request.height is None or request.width is None:
        if z.shape[0] == c and request.height is None and request.width is None:  # [C, H, W]: no batch dim
            raise InvalidInput(
                "latents",
                f"shape {list(z.shape)} has no batch dimension: send {[1, *z.shape]} (or, for packed latents "
                f"[B, L, {c * p * p}], give height and width)",
            )
        raise InvalidInput(
            "height" if request.height is None else "width",
            f"is required for packed latents [B, L, {c * p * p}] (the output size in pixels)",
        )
    b, length, packed_c = z.shape
    if packed_c != c * p * p:
        raise InvalidInput(
            "latents",
            f"packed latents need last dim {c * p * p} ({p * p} x {c} channels) for model '{spec.name}', "
            f"got shape {list(z.shape)}",
        )
    # the pipelines' own rounding: whole 2x2 latent patches of the decoder's scale
    h = 2 * (request.height // (spec.spatial_scale * 2))
    w = 2 * (request.width // (spec.spatial_scale * 2))
    if h == 0 or w == 0 or length != (h // p) * (w // p):
        raise InvalidInput(
            "latents",
            f"{length} packed tokens do not match height={request.height}, width={request.width} "
            f"(expected {(h // p) * (w // p)})",
        )
    return z.view(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def _unpatchify(z: torch.Tensor) -> torch.Tensor:
    b, c4, h, w = z.shape
    return z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)


def _expected(spec: ModelSpec) -> str:
    """The forms the model takes, then their ranks: "[B, 4, H, W] or packed [B, L, 16] with
    height/width (4 or 3 dims)"."""
    c = spec.latent_channels
    forms, ranks = [f"[B, {c}, T, H, W] or [B, {c}, H, W]" if spec.geometry.video_latents else f"[B, {c}, H, W]"], [4]
    if spec.geometry.video_latents:
        ranks.insert(0, 5)
    if spec.entry.patchified:
        forms.append(f"patchified [B, {4 * c}, h, w]")
    if spec.entry.packed_patch:
        forms.append(f"packed [B, L, {c * spec.entry.packed_patch**2}] with height/width")
        ranks.append(3)
    return f"{' or '.join(forms)} ({' or '.join(map(str, ranks))} dims)"


def _wrong_shape(shape: list[int], spec: ModelSpec) -> InvalidInput:
    """Which ranks and channels the model takes; a shape that is an accepted one without its batch
    dimension says so (NumPy and torch users often drop it for one latent)."""
    message = f"model '{spec.name}' takes {_expected(spec)}; got {len(shape)} dims {shape}"
    lacks_batch = len(shape) in ((3, 4) if spec.geometry.video_latents else (3,)) and shape[0] in (
        spec.latent_channels,
        4 * spec.latent_channels if spec.entry.patchified else -1,
    )
    if lacks_batch:
        message += f": the batch dimension is missing? send {[1, *shape]}"
    return InvalidInput("latents", message)


def to_decoder_layout(request: DecodeRequest, spec: ModelSpec) -> tuple[torch.Tensor, Form]:
    """The request's latents in the decoder's layout, and the form they came in. Raises InvalidInput."""
    z, c, entry = request.latents, spec.latent_channels, spec.entry
    form: Form = "decoder"
    if z.dim() == 3 and entry.packed_patch:
        z, form = _unpack(z, request, spec), "packed"
    elif z.dim() == 4 and entry.patchified and z.shape[1] == 4 * c:
        z, form = _unpatchify(z), "patchified"
    if spec.geometry.video_latents and z.dim() == 4:  # one frame, given as an image latent
        z = z.unsqueeze(2)
    if z.dim() != (5 if spec.geometry.video_latents else 4) or z.shape[1] != c:
        raise _wrong_shape(list(request.latents.shape), spec)
    if form != "packed":  # sent but unused, they would silently promise an output size
        for key in ("height", "width"):
            if getattr(request, key) is not None:
                raise InvalidInput(
                    key,
                    f"is only for packed latents [B, L, C]; these latents {list(request.latents.shape)} fix the "
                    f"output size ({z.shape[-2] * spec.spatial_scale} x {z.shape[-1] * spec.spatial_scale} pixels): "
                    "leave height and width out",
                )
    return z, form
