"""The switch between reference and fast forwards of one installed VAE."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class FastPathGate:
    """Patched forwards read `enabled`; only `use()` changes it, and always restores it."""

    def __init__(self) -> None:
        self._enabled = False

    @property
    def enabled(self) -> bool:
        return self._enabled

    @contextmanager
    def use(self, enabled: bool) -> Iterator[None]:
        previous = self._enabled
        self._enabled = enabled
        try:
            yield
        finally:
            self._enabled = previous
