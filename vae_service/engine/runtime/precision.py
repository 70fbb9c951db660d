"""Device and decode-precision resolution (`auto` = bf16 on CUDA, fp32 on CPU)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISION_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: '{device}' was asked for but CUDA is not available")
    return resolved


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if precision not in DTYPES:
        raise ValueError(f"decode_precision: {precision!r} is not one of ['auto', 'fp32', 'fp16', 'bf16']")
    return DTYPES[precision]
