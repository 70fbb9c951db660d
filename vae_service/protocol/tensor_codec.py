"""Tensors on the wire: `{"dtype": str, "shape": [int], "data": bytes}`, little-endian, C order.

Raw bytes only; nothing is ever unpickled. bfloat16 goes through torch because numpy has no
such dtype.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from vae_service.errors import RequestError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}
LATENT_DTYPES = ("float32", "float16", "bfloat16")
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_MAX_NDIM = 6

assert sys.byteorder == "little", "the wire format is little-endian; big-endian hosts are not supported"


def encode_tensor(x: torch.Tensor | np.ndarray) -> dict:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x.detach()
    if t.dtype not in _NAMES:
        raise TypeError(f"cannot send dtype {t.dtype}; supported: {list(WIRE_DTYPES)}")
    t = t.cpu().contiguous()
    return {
        "dtype": _NAMES[t.dtype],
        "shape": list(t.shape),
        "data": t.reshape(-1).view(torch.uint8).numpy().tobytes(),
    }


def decode_tensor(obj: object, field: str, allowed_dtypes: tuple[str, ...] = tuple(WIRE_DTYPES)) -> torch.Tensor:
    """Validate a tensor map and return a tensor that owns its memory. Errors name `field`."""
    if not isinstance(obj, dict):
        raise RequestError(field, "must be a map with keys dtype, shape, data")
    if set(obj) != {"dtype", "shape", "data"}:
        raise RequestError(field, f"must have exactly the keys dtype, shape, data; got {sorted(map(str, obj))}")
    dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype_name not in allowed_dtypes:
        raise RequestError(f"{field}.dtype", f"unknown dtype {dtype_name!r}; allowed: {list(allowed_dtypes)}")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= _MAX_NDIM:
        raise RequestError(f"{field}.shape", f"must be a list of 1 to {_MAX_NDIM} ints")
    if any(type(d) is not int for d in shape):
        raise RequestError(f"{field}.shape", f"dims must be ints, got {shape!r}")
    if any(d <= 0 for d in shape):
        raise RequestError(f"{field}.shape", f"dims must be positive, got {list(shape)}")
    if not isinstance(data, (bytes, bytearray)):
        raise RequestError(f"{field}.data", "must be binary (msgpack bin)")
    dtype = WIRE_DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise RequestError(
            f"{field}.data",
            f"has {len(data)} bytes but shape {list(shape)} of {dtype_name} needs {expected}",
        )
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: bf16 comes out as float32 (exact); other dtypes unchanged."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def require_finite(t: torch.Tensor, field: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise RequestError(field, f"contains {bad} NaN or Inf values")
