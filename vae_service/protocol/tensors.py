"""Wire tensors <-> torch, without copies: latents alias the request's bytes (the engine casts
them into new tensors before anything could write), outputs are handed to the packer as views."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from vae_service_client.tensors import WireTensor

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


def to_torch(wire: WireTensor) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only request bytes: see the module docstring
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(wire.data, dtype=_TORCH[wire.dtype]).reshape(wire.shape)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A caller's numpy array as a tensor, aliasing it (arrays from Ray handles are read-only)."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: bf16 comes out as float32 (exact); other dtypes unchanged, no copy."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
