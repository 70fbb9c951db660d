"""Folded weights of the fast path: derived tensors built lazily on the first `high` decode and
held outside the module tree, so the state dict never changes and they can be dropped at will.
Each belongs to the rewrite that built it, so /health can say what each rewrite costs."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import torch


class FoldedBuffers:
    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}  # (rewrite, name, device, dtype) -> tensor
        self._lock = threading.Lock()

    def get(self, rewrite: str, name: str, source: torch.Tensor, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor folded from `source`, rebuilt whenever the source's device or dtype changed."""
        key = (rewrite, name, source.device, source.dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
            with self._lock:
                for stale in [k for k in self._tensors if k[:2] == key[:2] and k != key]:
                    del self._tensors[stale]
                tensor = self._tensors.setdefault(key, build())
        return tensor

    def names(self, rewrite: str) -> list[str]:
        return [k[1] for k in self._tensors if k[0] == rewrite]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def nbytes_by_rewrite(self) -> dict[str, int]:
        sizes: dict[str, int] = defaultdict(int)
        for (rewrite, *_), t in list(self._tensors.items()):
            sizes[rewrite] += t.numel() * t.element_size()
        return dict(sizes)

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
