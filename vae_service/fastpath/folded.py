"""Folded weights of the fast path: derived tensors built lazily on the first `high` decode and
held outside the module tree, so the state dict never changes and they can be dropped at will."""

from __future__ import annotations

import threading
from typing import Callable

import torch


class FoldedBuffers:
    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, name: str, source: torch.Tensor, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor folded from `source`, rebuilt whenever the source's device or dtype changed."""
        key = (name, source.device, source.dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
            with self._lock:
                stale = [k for k in self._tensors if k[0] == name and k != key]
                for k in stale:
                    del self._tensors[k]
                tensor = self._tensors.setdefault(key, build())
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __len__(self) -> int:
        return len(self._tensors)

    def release(self) -> int:
        """Drop every folded tensor; return the bytes freed. On CUDA the cache goes back to the driver."""
        with self._lock:
            freed = self.nbytes
            on_cuda = any(t.is_cuda for t in self._tensors.values())
            self._tensors.clear()
        if on_cuda:
            torch.cuda.empty_cache()
        return freed
