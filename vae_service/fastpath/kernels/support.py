"""Which tensors a Triton kernel entry point takes: CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1 (tests), in a float dtype. The backend itself is chosen once, at install
(fastpath/rewrites.py); an entry point only declines inputs it cannot compute (returns None)."""

from __future__ import annotations

import os

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_takes(x: torch.Tensor) -> bool:
    return (x.is_cuda or interpreting()) and x.dtype in KERNEL_DTYPES


def channels_last_rows(x: torch.Tensor) -> bool:
    """True when x ([N,C,H,W] or [N,C,T,H,W]) is stored as contiguous rows of C channels."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return fmt is not None and x.is_contiguous(memory_format=fmt)
