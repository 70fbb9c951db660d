"""The switch between reference and fast forwards of one installed VAE."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class FastPathGate:
    """Patched forwards read `enabled`; only `use()` changes it, and always restores it. Per thread:
    a `lossless` decode on one thread never sees the switch a `high` decode set on another."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def enabled(self) -> bool:
        return getattr(self._local, "enabled", False)

    @contextmanager
    def use(self, enabled: bool) -> Iterator[None]:
        previous = self.enabled
        self._local.enabled = enabled
        try:
            yield
        finally:
            self._local.enabled = previous
