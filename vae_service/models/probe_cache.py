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

Meta-device work beyond these probes is done for one caller (a per-shape price, a frame count
traced for a request) and grows with what it asked: it runs under that caller's check
(`checked_by`), which it calls before each of its ops (`checkpoint`), so it stops within one op of
the caller's end. The probes here run for nobody in particular and are shared by every later
caller: they run unchecked (`checked_by(None)`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from torch.utils._python_dispatch import TorchDispatchMode

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


# ---- meta-device work done for a caller ------------------------------------------------------
_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("vae_service_meta_work_check", default=None)


class _Stopped(BaseException):
    """Carries the caller's check's exception from an op to `checked_by`, past every `except
    Exception` in between (diffusers', a trace's failure turned into a refusal): the caller gets its
    own error (a timeout, an abandonment), never one that blames the model."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


@contextmanager
def checked_by(check: Callable[[], None] | None) -> Iterator[None]:
    """Meta-device work on this thread calls `check` before each of its ops (`checkpoint`); what
    `check` raises ends the work and leaves this block as raised. None: unchecked (work shared by
    every later caller, such as a probe made once per architecture)."""
    token = _CHECK.set(check)
    try:
        yield
    except _Stopped as stopped:
        raise stopped.error from None
    finally:
        _CHECK.reset(token)


def checkpoint() -> None:
    """The running check, if any: called before every op of meta-device work (by the dispatch
    mode that counts its bytes, or by `checking`'s)."""
    check = _CHECK.get()
    if check is None:
        return
    try:
        check()
    except Exception as error:
        raise _Stopped(error) from None


class _Checking(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        checkpoint()
        return func(*args, **(kwargs or {}))


def checking() -> AbstractContextManager:
    """Around meta-device work that no other dispatch mode of ours watches (a trace): the running
    check before each op; nothing where none is set."""
    return _Checking() if _CHECK.get() is not None else nullcontext()
