"""The one cache of start-up probes: what an engine measures once about its architecture on the
meta device (traced geometry, each tier's memory lines, the folded weights' size, the FLOP fit, the
class tiled decode's fit). Engines of the same architecture in one process (tests, benchmarks, a
multi-model application) probe once.

Its owner is the process: `ProbeCache.process()` is the instance every engine uses unless it is
handed another (a test that wants fresh probes passes its own). Entries are keyed by what they
depend on, an `Architecture` plus the probe's own name; nothing else is cached anywhere. Probes
are small and few (a handful per architecture), so the cache is never trimmed. The process's cache
also keeps, on disk, every answer whose probe gives a codec (models/probe_store.py): other
processes of the architecture read it instead of probing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from vae_service.models.probe_store import Codec, ProbeStore


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

    def __init__(self, store: ProbeStore | None = None) -> None:
        self.store = store
        self._entries: dict[tuple[Hashable, str], Any] = {}
        self._locks: dict[tuple[Hashable, str], threading.Lock] = {}
        self._guard = threading.Lock()

    @classmethod
    def process(cls) -> ProbeCache:
        if cls._process is None:
            cls._process = ProbeCache(ProbeStore.from_environment())
        return cls._process

    def get(self, key: Hashable, probe: str, make: Callable[[], Any], codec: Codec | None = None) -> Any:
        """The probe's answer for `key`, made once (concurrent callers of one entry wait for it);
        with a `codec`, read from the store if another process made it, else written there."""
        entry = (key, probe)
        with self._guard:
            if entry in self._entries:
                return self._entries[entry]
            lock = self._locks.setdefault(entry, threading.Lock())
        with lock:
            if entry not in self._entries:
                self._entries[entry] = self._stored_or_made(key, probe, make, codec)
            return self._entries[entry]

    def _stored_or_made(self, key: Hashable, probe: str, make: Callable[[], Any], codec: Codec | None) -> Any:
        if self.store is None or codec is None:
            return make()
        stored = self.store.load(key, probe, codec)
        if stored is not None:
            return stored
        made = make()
        self.store.save(key, probe, codec, made)
        return made

    def peek(self, key: Hashable, probe: str) -> Any | None:
        """The probe's answer if it was made, else None (nothing is made)."""
        with self._guard:
            return self._entries.get((key, probe))

    def __len__(self) -> int:
        return len(self._entries)
