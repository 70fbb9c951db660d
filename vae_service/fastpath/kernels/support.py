"""When a Triton kernel may run: CUDA tensors, or any tensor under TRITON_INTERPRET=1 (tests on CPU),
never while torch.compile is tracing (an eager launch there would break the graph)."""

from __future__ import annotations

import os

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    if not (x.is_cuda or interpreting()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return x.dtype in KERNEL_DTYPES


def channels_last_rows(x: torch.Tensor) -> bool:
    """True when x ([N,C,H,W] or [N,C,T,H,W]) is stored as contiguous rows of C channels."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return fmt is not None and x.is_contiguous(memory_format=fmt)
