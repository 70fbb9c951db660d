"""Request bodies and response parsing shared by the sync and async clients."""

from __future__ import annotations

import asyncio
import io
import json
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

import msgpack
import numpy as np
import torch
from PIL import Image

from vae_service.protocol.decode_schema import UNSET, pack
from vae_service.protocol.tensor_codec import decode_tensor, encode_tensor, to_numpy

MSGPACK = "application/msgpack"
T = TypeVar("T")


class VaeServiceError(Exception):
    """A non-200 answer, with the server's error type, field and message. `status` is the HTTP
    status (gRPC codes are mapped to their HTTP equivalents)."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None, retry_after: float | None = None):
        super().__init__(f"HTTP {status} {type_}: {message}")
        self.status, self.type, self.message, self.field, self.retry_after = status, type_, message, field, retry_after


class InvalidRequest(VaeServiceError):
    """400/415/422: fix the request; retrying will not help."""


class PayloadTooLarge(VaeServiceError):
    """413: over a byte, pixel or batch limit."""


class Overloaded(VaeServiceError):
    """429/503: retried with backoff (honouring Retry-After) before it reaches you."""


class DecodeTimeout(VaeServiceError):
    """504: the server did not finish within its request timeout."""


class ServerError(VaeServiceError):
    """Any other 5xx: a server bug."""


def error_class(status: int) -> type[VaeServiceError]:
    if status in (429, 503):
        return Overloaded
    if status == 413:
        return PayloadTooLarge
    if status == 504:
        return DecodeTimeout
    if 400 <= status < 500:
        return InvalidRequest
    return ServerError


def retry_delay(attempt: int, error: VaeServiceError, backoff_s: float, max_backoff_s: float = 8.0) -> float:
    """Exponential backoff, but never sooner than the server's Retry-After."""
    return max(min(backoff_s * 2**attempt, max_backoff_s), error.retry_after or 0.0)


def with_retries(call: Callable[[], T], retries: int, backoff_s: float) -> T:
    """`call()` again while it raises Overloaded, up to `retries` more times."""
    for attempt in range(retries):
        try:
            return call()
        except Overloaded as exc:
            time.sleep(retry_delay(attempt, exc, backoff_s))
    return call()


async def with_retries_async(call: Callable[[], Awaitable[T]], retries: int, backoff_s: float) -> T:
    for attempt in range(retries):
        try:
            return await call()
        except Overloaded as exc:
            await asyncio.sleep(retry_delay(attempt, exc, backoff_s))
    return await call()


@dataclass
class DecodeResponse:
    output: np.ndarray | list[bytes]  # uint8/float arrays (bf16 arrives as float32), or encoded files
    model: str
    quality: str
    precision: str
    request_id: str | None
    timing: dict = field(default_factory=dict)

    def images(self) -> list[Image.Image]:
        """PIL images for png/jpeg outputs and for uint8 image outputs."""
        if isinstance(self.output, list):
            return [Image.open(io.BytesIO(b)) for b in self.output]
        if self.output.dtype != np.uint8 or self.output.ndim != 4:
            raise ValueError("images() needs output='uint8', 'png' or 'jpeg' from an image model")
        return [Image.fromarray(a) for a in self.output]


def decode_body(latents: torch.Tensor | np.ndarray, quality: str = "lossless", output: str = "uint8", *,
                scaling_factor=UNSET, shift_factor=UNSET, height: int | None = None, width: int | None = None,
                request_id: str | None = None, model: str | None = None) -> bytes:
    body = {"latents": encode_tensor(latents), "quality": quality, "output": output}
    optional = {"scaling_factor": scaling_factor, "shift_factor": shift_factor}
    body.update({k: v for k, v in optional.items() if v is not UNSET})
    extra = {"height": height, "width": width, "request_id": request_id, "model": model}
    body.update({k: v for k, v in extra.items() if v is not None})
    return pack(body)


def parse_response(status: int, headers, content: bytes) -> DecodeResponse:
    if status != 200:
        raise error_from(status, headers, content)
    obj = msgpack.unpackb(content, raw=False)
    out = obj["output"]
    if isinstance(out, dict):
        tensor = decode_tensor(out, "output")
        out = to_numpy(tensor)
    return DecodeResponse(out, obj["model"], obj["quality"], obj["precision"], obj.get("request_id"), obj["timing"])


def error_from(status: int, headers, content: bytes) -> VaeServiceError:
    retry = headers.get("retry-after")
    try:
        err = json.loads(content)["error"]
        type_, message, field_ = err.get("type", "error"), err.get("message", ""), err.get("field")
    except (ValueError, KeyError, TypeError):
        type_, message, field_ = "error", content[:500].decode(errors="replace"), None
    return error_class(status)(status, type_, message, field_, float(retry) if retry else None)
