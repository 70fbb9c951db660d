"""The Hugging Face hybrid-inference VAE protocol, as spoken by
`diffusers.utils.remote_utils.remote_decode`: a raw tensor body (`Content-Type: tensor/binary`),
parameters in the query string (`shape` repeated, `dtype`, `output_type`, `image_format`,
`partial_postprocess`, `scaling_factor`/`shift_factor` or `do_scaling`, `height`/`width`), and an
answer chosen by output type: one image (`Accept: image/jpeg|png`), a raw tensor with `shape` and
`dtype` headers, or an mp4. `quality` (lossless|high), `model` and `priority` (the scheduler's class:
realtime|interactive|bulk; absent: the deployment's default) are our extra parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

from vae_service.engine.request.decode_request import DecodeRequest
from vae_service.engine.request.errors import InvalidInput
from vae_service.engine.request.result import DecodeResult
from vae_service.protocol.errors import UnsupportedMediaType
from vae_service.protocol.tensors import to_torch
from vae_service_client.tensors import LATENT_DTYPES, decode_tensor, encode_tensor

TENSOR_TYPES = ("tensor/binary", "application/octet-stream")
Reply = Literal["image", "tensor", "tensor01", "mp4"]


@dataclass(frozen=True)
class RemoteDecodePlan:
    request: DecodeRequest
    reply: Reply  # image: one encoded image; tensor: raw output; tensor01: float in [0, 1]; mp4


Query = dict[str, list[str]]  # a query string's parameters, each with all its values


def _get(query: Query, key: str, default: str | None = None) -> str | None:
    values = query.get(key)
    return values[-1] if values else default


def _flag(query: Query, key: str) -> bool:
    value = _get(query, key, "False")
    if value not in ("True", "False", "true", "false", "1", "0"):
        raise InvalidInput(key, f"must be True or False, got {value!r}")
    return value in ("True", "true", "1")


def _number(query: Query, key: str, cast=float):
    raw = _get(query, key)
    if raw is None:
        return None
    try:
        value = cast(raw)
    except ValueError:
        raise InvalidInput(key, f"must be a number, got {raw!r}") from None
    if cast is float and not math.isfinite(value):
        raise InvalidInput(key, f"must be finite, got {raw!r}")
    return value


def parse_remote_decode(body: bytes, content_type: str | None, accept: str | None, query: Query) -> RemoteDecodePlan:
    if not body:  # named before the Content-Type: a client that sent nothing often sent no type either
        raise InvalidInput("body", "is empty: POST /remote-decode takes the latents' raw bytes")
    if (content_type or "").split(";")[0].strip().lower() not in TENSOR_TYPES:
        raise UnsupportedMediaType("Content-Type", f"must be tensor/binary, got {content_type or 'nothing'!r}")
    try:
        shape = [int(d) for d in query.get("shape", [])]
    except ValueError:
        raise InvalidInput("shape", f"must be ints, got {query.get('shape')}") from None
    if not shape:
        raise InvalidInput("shape", "is required (one query parameter per dimension)")
    latents = to_torch(
        decode_tensor(
            {"dtype": _get(query, "dtype", "float32"), "shape": shape, "data": body}, "latents", LATENT_DTYPES
        )
    )

    output_type = _get(query, "output_type", "pil")
    image_format = _get(query, "image_format", "jpg")
    partial = _flag(query, "partial_postprocess")
    if output_type not in ("pil", "pt", "mp4"):
        raise InvalidInput("output_type", f"unknown value {output_type!r}; allowed: ['pil', 'pt', 'mp4']")
    if image_format not in ("jpg", "png"):
        raise InvalidInput("image_format", f"unknown value {image_format!r}; allowed: ['jpg', 'png']")
    wants_tensor = (accept or "").startswith("tensor/binary")
    if output_type == "mp4":
        output, reply = "mp4", "mp4"
        if latents.shape[0] != 1:
            raise InvalidInput("shape", "output_type mp4 answers one video: send a batch of 1")
    elif output_type == "pt":
        output, reply = ("uint8" if partial else "float"), "tensor"
    elif wants_tensor:  # pil with a client-side processor: it expects floats in [0, 1]
        output, reply = "float", "tensor01"
    else:
        output, reply = ("jpeg" if image_format == "jpg" else "png"), "image"
        if latents.shape[0] != 1:
            raise InvalidInput("shape", "output_type pil answers one image: send a batch of 1, or use pt")

    scaling, shift = _number(query, "scaling_factor"), _number(query, "shift_factor")
    # factors sent replace the model's (one not sent is skipped); neither sent: the model's own with
    # do_scaling=True, else the latents are already scaled
    own = scaling is None and shift is None and _flag(query, "do_scaling")
    request = DecodeRequest(
        latents=latents,
        quality=_get(query, "quality", "lossless"),
        output=output,
        scaling_factor=scaling,
        shift_factor=shift,
        latents_scaled=not own,
        # diffusers' remote_decode sends height/width whenever its caller gives them, and the hub's
        # endpoints ignore them for unpacked latents: only packed latents [B, L, C] carry them here
        height=_number(query, "height", int) if latents.dim() == 3 else None,
        width=_number(query, "width", int) if latents.dim() == 3 else None,
        model=_get(query, "model"),
        priority=_get(query, "priority"),
    )
    return RemoteDecodePlan(request, reply)


def remote_decode_reply(plan: RemoteDecodePlan, result: DecodeResult) -> tuple[bytes, str, dict]:
    """(body, media type, headers) for the decoded output."""
    output = result.output
    if plan.reply == "image":
        return output[0], "image/jpeg" if plan.request.output == "jpeg" else "image/png", {}
    if plan.reply == "mp4":
        return output[0], "video/mp4", {}
    if plan.reply == "tensor01":
        output = (output / 2 + 0.5).clamp(0, 1)  # what VaeImageProcessor.postprocess(output_type="pt") gives
    wire = encode_tensor(output)
    return bytes(wire["data"]), "tensor/binary", {"shape": json.dumps(wire["shape"]), "dtype": wire["dtype"]}
