"""Tensors on the wire: `{"dtype": str, "shape": [int], "data": bytes}`, little-endian, C order.

Raw bytes only; nothing is ever unpickled. numpy has no bfloat16: bf16 data decodes to float32
(exact: a bf16 value is the top half of the float32 with the same value). torch tensors are
accepted when torch is installed, but torch is never imported here: a tensor passed in proves it
is already loaded.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

WIRE_DTYPES = ("float32", "float16", "bfloat16", "uint8")
LATENT_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}
MAX_NDIM = 6
_NUMPY = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "uint8": np.dtype("u1")}

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("the wire format is little-endian; big-endian hosts are not supported")


class WireError(ValueError):
    """Data that breaks the wire format; `field` names where (e.g. `latents.shape`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


@dataclass(frozen=True)
class WireTensor:
    """A validated tensor map: `data` holds exactly prod(shape) items of `dtype`."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def to_numpy(self) -> np.ndarray:
        """A read-only view of `data` (bf16 widened to a new float32 array)."""
        if self.dtype == "bfloat16":
            halves = np.frombuffer(self.data, dtype="<u2").astype(np.uint32)
            return (halves << 16).view(np.float32).reshape(self.shape)
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape)


def _is_torch_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _torch_to_numpy(t) -> tuple[str, np.ndarray]:
    import torch  # already loaded: the caller handed us a tensor

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return "bfloat16", t.view(torch.int16).numpy()
    return _numpy_name(t.numpy()), t.numpy()


def _numpy_name(a: np.ndarray) -> str:
    for name, dtype in _NUMPY.items():  # any byte order: the copy below makes it little-endian
        if (a.dtype.kind, a.dtype.itemsize) == (dtype.kind, dtype.itemsize):
            return name
    raise TypeError(f"cannot send dtype {a.dtype}; supported: {list(WIRE_DTYPES)}")


def encode_tensor(x) -> dict:
    """A numpy array or torch tensor -> tensor map. `data` is a memoryview of a C-ordered,
    little-endian copy only when x is not one already (msgpack packs it without a copy)."""
    if _is_torch_tensor(x):
        name, array = _torch_to_numpy(x)
    else:
        array = np.asarray(x)
        name = _numpy_name(array)
        array = np.ascontiguousarray(array, dtype=_NUMPY[name])
    return {"dtype": name, "shape": list(array.shape), "data": memoryview(array).cast("B")}


def decode_tensor(obj: object, field: str, allowed: tuple[str, ...] = WIRE_DTYPES) -> WireTensor:
    """Validate a tensor map; errors name `field` (or `field.dtype`, `.shape`, `.data`)."""
    if not isinstance(obj, dict):
        raise WireError(field, "must be a map with keys dtype, shape, data")
    if set(obj) != {"dtype", "shape", "data"}:
        raise WireError(field, f"must have exactly the keys dtype, shape, data; got {sorted(map(str, obj))}")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in allowed:
        raise WireError(f"{field}.dtype", f"unknown dtype {dtype!r}; allowed: {list(allowed)}")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= MAX_NDIM:
        raise WireError(f"{field}.shape", f"must be a list of 1 to {MAX_NDIM} ints")
    if any(type(d) is not int for d in shape):
        raise WireError(f"{field}.shape", f"dims must be ints, got {list(shape)!r}")
    if any(d <= 0 for d in shape):
        raise WireError(f"{field}.shape", f"dims must be positive, got {list(shape)}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{field}.data", "must be binary (msgpack bin)")
    expected = math.prod(shape) * ITEMSIZE[dtype]
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size != expected:
        raise WireError(f"{field}.data", f"has {size} bytes but shape {list(shape)} of {dtype} needs {expected}")
    return WireTensor(dtype, tuple(shape), data)
