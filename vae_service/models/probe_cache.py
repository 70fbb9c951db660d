"""The one cache of start-up probes: what an engine measures once about its architecture on the
meta device (traced geometry, each tier's memory lines, the folded weights' size, the FLOP fit, the
class tiled decode's fit). Engines of the same architecture in one process (tests, benchmarks, a
multi-model application) probe once.

Its owner is the process: `ProbeCache.process()` is the instance every engine uses unless it is
handed another (a test that wants fresh probes passes its own). Entries are keyed by what they
depend on, an `Architecture` plus the probe's own name; nothing else is cached anywhere. Probes
are small and few (a handful per architecture), so the cache is never trimmed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar


def config_digest(config: dict) -> str:
    """The config's digest, without diffusers' bookkeeping (`_`-keys: where it was loaded from, which
    keys took defaults, in an order that differs between processes): two replicas of one model
    agree on it."""
    kept = {k: v for k, v in config.items() if not k.startswith("_")}
    return hashlib.blake2b(json.dumps(kept, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Architecture:
    """What a probe's answer depends on: the class and its config (never the weights: probes run on
    the meta device), the modules the service dropped, and where and how it decodes."""

    cls: type
    config: str  # config_digest of the model's config
    dropped: tuple[str, ...] = ()
    dtype: str = ""
    device: str = ""
    rewrites: tuple[tuple[str, str], ...] = ()


class ProbeCache:
    _process: ClassVar[ProbeCache | None] = None

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, str], Any] = {}
        self._locks: dict[tuple[Hashable, str], threading.Lock] = {}
        self._guard = threading.Lock()

    @classmethod
    def process(cls) -> ProbeCache:
        if cls._process is None:
            cls._process = ProbeCache()
        return cls._process

    def get(self, key: Hashable, probe: str, make: Callable[[], Any]) -> Any:
        """The probe's answer for `key`, made once (concurrent callers of one entry wait for it)."""
        entry = (key, probe)
        with self._guard:
            if entry in self._entries:
                return self._entries[entry]
            lock = self._locks.setdefault(entry, threading.Lock())
        with lock:
            if entry not in self._entries:
                self._entries[entry] = make()
            return self._entries[entry]

    def peek(self, key: Hashable, probe: str) -> Any | None:
        """The probe's answer if it was made, else None (nothing is made)."""
        with self._guard:
            return self._entries.get((key, probe))

    def __len__(self) -> int:
        return len(self._entries)
