"""The `POST /decode` msgpack contract (see DESIGN.md): parse and validate a request body into
`DecodeParams`, and encode a response. Model-specific checks (channels, pixel budget) belong to
the engine, which knows the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from vae_service.config import Limits
from vae_service.errors import PayloadTooLarge, RequestError, UnsupportedMediaType
from vae_service.protocol.tensor_codec import (
    LATENT_DTYPES,
    WIRE_DTYPES,
    decode_tensor,
    encode_tensor,
    require_finite,
)

Quality = Literal["lossless", "high"]
OutputKind = Literal["uint8", "float", "png", "jpeg", "mp4"]
QUALITIES: tuple[str, ...] = ("lossless", "high")
OUTPUTS: tuple[str, ...] = ("uint8", "float", "png", "jpeg", "mp4")
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_MAX_REQUEST_ID = 256
LATENT_TORCH_DTYPES = tuple(WIRE_DTYPES[d] for d in LATENT_DTYPES)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # key absent: use the model's own factor (nil means "already scaled")

_KEYS = {"latents", "quality", "output", "scaling_factor", "shift_factor", "height", "width", "request_id", "model"}


@dataclass(frozen=True)
class DecodeParams:
    latents: torch.Tensor
    quality: str = "lossless"
    output: str = "uint8"
    scaling_factor: float | None | _Unset = UNSET
    shift_factor: float | None | _Unset = UNSET
    height: int | None = None
    width: int | None = None
    request_id: str | None = None
    model: str | None = None


def check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";")[0].strip().lower()
    if media not in MSGPACK_TYPES:
        raise UnsupportedMediaType(
            "Content-Type", f"must be application/msgpack, got {content_type or 'nothing'!r}"
        )


def check_body_size(size: int, limits: Limits) -> None:
    if size > limits.max_request_bytes:
        raise PayloadTooLarge("body", f"{size} bytes is over the limit of {limits.max_request_bytes} (max_request_bytes)")


def _refuse_ext(code: int, data: bytes) -> None:
    raise RequestError("body", f"msgpack extension types are not accepted (ext code {code})")


def unpack_body(body: bytes, limits: Limits) -> dict:
    check_body_size(len(body), limits)
    try:
        obj = msgpack.unpackb(body, raw=False, ext_hook=_refuse_ext, strict_map_key=True, max_bin_len=limits.max_request_bytes)
    except RequestError:
        raise
    except Exception as exc:  # truncated, extra data, bad utf-8, over-deep nesting: all malformed input
        raise RequestError("body", f"is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise RequestError("body", f"must be a msgpack map, got {type(obj).__name__}")
    return obj


def _factor(obj: dict, key: str, nonzero: bool) -> float | None | _Unset:
    if key not in obj:
        return UNSET
    v = obj[key]
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v) or (nonzero and v == 0):
        raise RequestError(key, f"must be a finite {'non-zero ' if nonzero else ''}number or nil, got {v!r}")
    return float(v)


def _pixels(obj: dict, key: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if type(v) is not int or v <= 0:
        raise RequestError(key, f"must be a positive int, got {v!r}")
    return v


def _choice(obj: dict, key: str, allowed: tuple[str, ...], default: str) -> str:
    v = obj.get(key, default)
    if v not in allowed:
        raise RequestError(key, f"unknown value {v!r}; allowed: {list(allowed)}")
    return v


def _optional_str(obj: dict, key: str) -> str | None:
    v = obj.get(key)
    if v is not None and (not isinstance(v, str) or len(v) > _MAX_REQUEST_ID):
        raise RequestError(key, f"must be a string of at most {_MAX_REQUEST_ID} characters")
    return v


def params_from_map(obj: dict) -> DecodeParams:
    if "latents" not in obj:
        raise RequestError("latents", "is required")
    return _params(obj, decode_tensor(obj["latents"], "latents", LATENT_DTYPES))


def params_from_call(latents, **fields) -> DecodeParams:
    """The handle API's arguments (a torch tensor or numpy array, plus the /decode keys as
    keyword arguments) through the same validation as a msgpack body, without a copy."""
    if isinstance(latents, np.ndarray):
        latents = torch.from_numpy(np.array(latents) if not latents.flags.writeable else latents)
    if not isinstance(latents, torch.Tensor):
        raise RequestError("latents", f"must be a torch tensor or numpy array, got {type(latents).__name__}")
    if latents.dtype not in LATENT_TORCH_DTYPES:
        raise RequestError("latents.dtype", f"unknown dtype {latents.dtype}; allowed: {list(LATENT_DTYPES)}")
    if not 1 <= latents.dim() <= 6 or latents.numel() == 0:
        raise RequestError("latents.shape", f"must have 1 to 6 non-empty dims, got {list(latents.shape)}")
    return _params({"latents": None, **fields}, latents.detach().cpu())


def _params(obj: dict, latents: torch.Tensor) -> DecodeParams:
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise RequestError(unknown[0], f"unknown key; allowed keys: {sorted(_KEYS)}")
    require_finite(latents, "latents")
    return DecodeParams(
        latents=latents,
        quality=_choice(obj, "quality", QUALITIES, "lossless"),
        output=_choice(obj, "output", OUTPUTS, "uint8"),
        scaling_factor=_factor(obj, "scaling_factor", nonzero=True),
        shift_factor=_factor(obj, "shift_factor", nonzero=False),
        height=_pixels(obj, "height"),
        width=_pixels(obj, "width"),
        request_id=_optional_str(obj, "request_id"),
        model=_optional_str(obj, "model"),
    )


def parse_decode_request(body: bytes, content_type: str | None, limits: Limits) -> DecodeParams:
    check_content_type(content_type)
    return params_from_map(unpack_body(body, limits))


def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def response_map(
    output: torch.Tensor | list[bytes], *, model: str, quality: str, precision: str,
    request_id: str | None, timing: dict,
) -> dict:
    return {
        "output": output if isinstance(output, list) else encode_tensor(output),
        "model": model,
        "quality": quality,
        "precision": precision,
        "request_id": request_id,
        "timing": timing,
    }


def peek_model(body: bytes) -> str | None:
    """The `model` key of a msgpack /decode body, read without unpacking the latents (routing).
    None when absent or when the body is malformed: the decoder then answers the precise 400."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(body)
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "model":
                value = unpacker.unpack()
                return value if isinstance(value, str) else None
            unpacker.skip()
    except Exception:  # malformed: not the router's to judge
        return None
    return None
