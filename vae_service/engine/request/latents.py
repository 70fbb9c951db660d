"""From a DecodeRequest to decoder input, in two steps:

- before queueing (the engine's `check`): bring the latents into the decoder's layout
  (engine/request/latent_forms.py) and check them against the model's traced geometry (`decoder_latents`),
  the output they ask for (`check_output`) and for NaN/Inf (`check_finite`); the limits are the cost
  model's (engine/pricing/cost_model.py), checked between the first and the last;
- `to_decoder_input` (on the device thread): move, cast, undo the latent normalisation.

The normalisation is the model's pipeline's, op for op (models/normalisation.py), so that a
lossless decode is bit-identical to the pipeline's `vae.decode`. Explicit `scaling_factor` /
`shift_factor` replace it with `z / scaling + shift` (`latents_scaled`: a factor not given is skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.decode_request import IMAGE_OUTPUTS, VIDEO_OUTPUTS, DecodeRequest
from vae_service.engine.request.errors import InvalidInput
from vae_service.engine.request.latent_forms import Form, to_decoder_layout
from vae_service.models.normalisation import Denormaliser, Normalisation, divide_and_shift
from vae_service.models.spec import DEFAULT_DECODE_TIMESTEP, ModelSpec


class BatchKey(NamedTuple):
    """Requests with equal keys may share one decoder call; nothing else may."""

    quality: str
    latent_shape: tuple[int, ...]  # without the batch dim, in decoder layout
    dtype: torch.dtype  # of the latents as sent
    tiling: object  # how it is tiled (engine.planner's Tiling: a TileGrid, ClassTiles, or None: whole)
    timestep: float | None  # the decode timestep of timestep-conditioned decoders (LTX)


@dataclass(frozen=True)
class PreparedRequest:
    request: DecodeRequest
    latents: torch.Tensor  # [B, C, H, W] or [B, C, T, H, W] in decoder layout (not yet cast or moved)
    frames: int  # output frames per item (1 for images)
    form: Form = "decoder"  # how the latents were sent
    timestep: float | None = None  # the decode timestep (timestep-conditioned decoders only)
    context: RequestContext | None = None  # deadline, abandonment, live limits (engine/request/context.py)
    sink: Callable | None = None  # streaming: gets each chunk's frames (engine.video.FrameChunk) at once
    tiling: object = None  # the planner's: a TileGrid, ClassTiles, or None (whole)

    @property
    def items(self) -> int:
        return self.latents.shape[0]

    @property
    def batch_key(self) -> BatchKey:
        return BatchKey(
            self.request.quality, tuple(self.latents.shape[1:]), self.latents.dtype, self.tiling, self.timestep
        )

    @property
    def latent_frames(self) -> int:
        return self.latents.shape[2] if self.latents.dim() == 5 else 1

    @property
    def latent_hw(self) -> tuple[int, int]:
        h, w = self.latents.shape[-2:]
        return h, w


def _check_geometry(z: torch.Tensor, spec: ModelSpec) -> None:
    """What this model's traced geometry and statistics can decode; a 400 instead of a decoder crash."""
    side, geometry = spec.geometry.min_latent_side, spec.geometry
    if min(z.shape[-2:]) < side:
        raise InvalidInput(
            "latents", f"model '{spec.name}' decodes latents of at least {side}x{side}, got {list(z.shape)}"
        )
    if z.dim() != 5:
        return
    t = z.shape[2]
    if spec.family == "image" and t != 1:
        raise InvalidInput("latents", f"model '{spec.name}' decodes images: one latent frame, got {t}")
    if t < geometry.min_latent_frames:
        raise InvalidInput(
            "latents", f"model '{spec.name}' decodes at least {geometry.min_latent_frames} latent frames, got {t}"
        )
    covered = spec.normalisation.stats_frames(spec.latent_channels)
    if covered is not None and t > covered:
        raise InvalidInput("latents", f"model '{spec.name}''s latent statistics cover {covered} latent frames, got {t}")


def _timestep(request: DecodeRequest, spec: ModelSpec) -> float | None:
    if not spec.timestep_conditioned:
        if request.decode_timestep is not None:
            raise InvalidInput("decode_timestep", f"model '{spec.name}''s decoder is not timestep-conditioned")
        return None
    return DEFAULT_DECODE_TIMESTEP if request.decode_timestep is None else request.decode_timestep


# What the encoders can write, checked before any decode (PIL refuses wider JPEGs, libwebp wider
# WebPs; x264 and libvpx with 4:2:0 need even sides, which an 8x VAE always gives). AVIF: aom
# writes up to 65536, but libavif's decoders refuse a side over 32768 by default (Pillow cannot
# open one), so no wider AVIF is answered.
MAX_IMAGE_SIDE = {"jpeg": 65_500, "webp": 16_383, "avif": 32_768}
STREAMED_OUTPUTS = ("uint8", "float", *VIDEO_OUTPUTS)  # a video: one fragmented file (serving/outputs/video_stream.py)


def check_output(request: DecodeRequest, spec: ModelSpec, frames: int, z: torch.Tensor) -> None:
    output = request.output
    if output in VIDEO_OUTPUTS and spec.family != "video":
        raise InvalidInput("output", f"'{output}' is for video models; model '{spec.name}' decodes images")
    height, width = z.shape[-2] * spec.spatial_scale, z.shape[-1] * spec.spatial_scale
    if max(height, width) > MAX_IMAGE_SIDE.get(output, max(height, width)):
        raise InvalidInput(
            "output",
            f"'{output}' holds at most {MAX_IMAGE_SIDE[output]} px per side; these latents decode to "
            f"{height}x{width}: use 'png', 'uint8' or 'float'",
        )
    if request.stream and (spec.family != "video" or output not in STREAMED_OUTPUTS):
        raise InvalidInput(
            "stream",
            f"streams frames of video models as {' or '.join(map(repr, STREAMED_OUTPUTS))}; "
            + (f"model '{spec.name}' decodes images" if spec.family != "video" else f"not '{output}'"),
        )
    if request.stream and output in VIDEO_OUTPUTS and z.shape[0] > 1:
        raise InvalidInput(
            "output",
            f"a streamed '{output}' is one video; these latents hold {z.shape[0]} items: send one per request, "
            f"or stream 'uint8'/'float' frames, or ask for whole '{output}' answers (one file per item)",
        )
    if output in IMAGE_OUTPUTS and frames > 1:
        raise InvalidInput(
            "output",
            f"'{output}' encodes single images but these latents decode to "
            f"{frames} frames; use {' or '.join(map(repr, VIDEO_OUTPUTS))}, 'uint8' or 'float'",
        )


def check_finite(z: torch.Tensor) -> None:
    finite = torch.isfinite(z)
    if not bool(finite.all()):
        raise InvalidInput("latents", f"contains {int((~finite).sum())} NaN or Inf values")


def decoder_latents(request: DecodeRequest, spec: ModelSpec) -> tuple[torch.Tensor, Form, float | None]:
    """The request's latents in decoder layout, checked against the model's geometry, how they were
    sent, and their decode timestep. Constant work beside the layout change."""
    if request.model is not None and request.model != spec.name:
        raise InvalidInput("model", f"unknown model {request.model!r}; served: ['{spec.name}']")
    z, form = to_decoder_layout(request, spec)
    _check_geometry(z, spec)
    return z, form, _timestep(request, spec)


class LatentScaling:
    """The model's latent normalisation on the device, in the decode dtype (built once); a request
    that sends `scaling_factor`/`shift_factor` gets `z / scaling + shift` instead (a factor it leaves
    out is the model's own where the model has plain factors and the latents are not already
    scaled, else skipped)."""

    def __init__(self, spec: ModelSpec, vae, dtype: torch.dtype):
        self.spec, self.dtype = spec, dtype
        self.model = Denormaliser(spec.normalisation, vae, spec.latent_channels, dtype)

    def to_decoder_input(self, prepared: PreparedRequest, device: torch.device) -> torch.Tensor:
        request, norm = prepared.request, self.spec.normalisation
        given = request.latents_scaled or request.scaling_factor is not None or request.shift_factor is not None
        as_sent = prepared.form == "decoder" and self.spec.entry.raw_is_decoded_as_is
        if not given and not as_sent:
            z = prepared.latents.to(device=device, dtype=self.model.work_dtype)
            return self.model.apply(z).to(self.dtype).contiguous()
        own = norm if norm.kind == "factors" and not as_sent and not request.latents_scaled else Normalisation()
        scaling = own.scaling if request.scaling_factor is None else request.scaling_factor
        shift = own.shift if request.shift_factor is None else request.shift_factor
        return divide_and_shift(prepared.latents.to(device=device, dtype=self.dtype), scaling, shift).contiguous()
