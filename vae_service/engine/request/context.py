"""One request's context, built once at admission and carried everywhere below it: `prepare`, the
scheduler, the engine's call, every tile, here or on another replica.

- `deadline`: an absolute time (time.monotonic) fixed at admission from the live
  `batching.request_timeout_s` of that moment: a request that waited in the queue has that much less
  time for its decode, its tiles and its encode, never a fresh timeout per stage;
- `abandoned`: set when the caller went away (a client that disconnected, a cancelled handle call);
- `limits`: the live limits it was admitted under (a `reconfigure` meanwhile does not change a
  request already admitted);
- `fingerprint`: the engine's (engine/runtime/fingerprint.py), carried by its tiles offered to other
  replicas, so that one that would decode other bits refuses them.

Every wait in the decode path waits in slices of at most `WAIT_SLICE_S` and checks both between
slices (`wait_until`): a request whose client left stops within a slice, one past its deadline
answers 504 (DecodeTimeout), never an error that blames a replica.

Work that grows with the request on the meta twin (a per-shape price, a frame count traced for it)
runs inside `bounding`: it checks the request before each op on the twin and stops within one op
of its end, with the same DecodeTimeout or DecodeAbandoned.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from vae_service.config import Limits
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout
from vae_service.models.probe_cache import checked_by

WAIT_SLICE_S = 0.05  # how long any wait in the decode path goes without looking at the request
UNBOUNDED_S = 10 * 365 * 86400.0  # "no deadline", as a time every timer and timeout accepts


@dataclass
class RequestContext:
    deadline: float  # time.monotonic() by which the answer must be ready
    limits: Limits
    fingerprint: str | None = None  # the admitting engine's (its tiles offered elsewhere carry it)
    abandoned: threading.Event = field(default_factory=threading.Event)
    _on_end: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def admit(cls, timeout_s: float, limits: Limits, fingerprint: str | None = None) -> RequestContext:
        """A request arriving now, under these live settings."""
        return cls(time.monotonic() + timeout_s, limits, fingerprint)

    @classmethod
    def unbounded(cls, limits: Limits, fingerprint: str | None = None) -> RequestContext:
        """In-process callers without a timeout (batch-decode, tests): never expires by itself."""
        return cls(time.monotonic() + UNBOUNDED_S, limits, fingerprint)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    @property
    def ended(self) -> bool:
        """Nobody waits for this answer any more (the caller left, or its deadline passed)."""
        return self.abandoned.is_set() or self.expired

    def abandon(self) -> None:
        """The caller went away: every wait for this request stops at its next slice, and what was
        registered with `on_end` (remote tile streams) is cancelled now."""
        self.abandoned.set()
        with self._lock:
            callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            callback()

    def on_end(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` when the request is abandoned (at once if it already was). Returns a
        function that unregisters it."""
        with self._lock:
            if not self.abandoned.is_set():
                self._on_end.append(callback)
                return lambda: self._forget(callback)
        callback()
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._on_end:
                self._on_end.remove(callback)

    def check(self, what: str = "the decode") -> None:
        """Raise when nobody waits for this answer any more."""
        if self.abandoned.is_set():
            raise DecodeAbandoned("body", f"the caller went away during {what}")
        if self.expired:
            raise DecodeTimeout("body", f"not decoded within request_timeout_s (timed out during {what})")

    def wait_until(self, done: Callable[[float], bool], what: str) -> None:
        """Call `done(slice_s)` (a wait of at most slice_s that says whether it finished) until it
        does, checking the request between slices."""
        while True:
            self.check(what)
            if done(min(WAIT_SLICE_S, max(self.remaining(), 0.0))):
                return

    @contextmanager
    def bounding(self, what: str = "pricing") -> Iterator[None]:
        """Meta-twin work for this request on this thread (engine/pricing/, models/geometry.py's
        traces) checks it before each op: it raises this request's DecodeTimeout or DecodeAbandoned
        within one op of its end, whatever handlers it passes on the way."""
        with checked_by(functools.partial(self.check, what)):
            yield
