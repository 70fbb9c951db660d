"""One sink's writes as a bulkhead: its own threads and its own bound, so a store that hangs holds
only that sink's capacity and never the others'.

A request is admitted with all its files or refused at once (`admit`): while `in_flight` writes
fill `capacity`, or while as many calls are `stuck`. Each file is written in a thread of its own
(a store client's call cannot be interrupted: a pool's threads stuck in one would queue every
later write behind it). A write its request stopped waiting for (the sink's write timeout, the
deadline, the caller gone) is `abandoned`: its slot is freed at once and its call counts as stuck
until its thread ends, so a store that accepts and never answers costs at most `capacity` such
threads before the sink refuses new writes, and the sink takes writes again as soon as its store
answers. Counted for /health and the metrics: written, failed, refused (busy)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Write:
    done: bool = False
    abandoned: bool = False


@dataclass
class SinkWrites:
    name: str
    capacity: int
    in_flight: int = 0
    stuck: int = 0
    written: int = 0
    failed: int = 0
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admit(self, files: int) -> bool:
        """Take `files` slots; False (counted as refused) when the sink is full: its writes in flight
        fill it (a request larger than the whole capacity is let in alone), or its stuck calls do."""
        with self._lock:
            full = self.stuck >= self.capacity or (self.in_flight and self.in_flight + files > self.capacity)
            if full:
                self.refused += 1
                return False
            self.in_flight += files
            return True

    def start(self, write: Callable[[], object]) -> tuple[asyncio.Future, _Write]:
        """Run one admitted file's `write()` in its own thread; the future of its result."""
        loop, state = asyncio.get_running_loop(), _Write()
        future = loop.create_future()

        def run() -> None:
            try:
                result, error = write(), None
            except BaseException as exc:  # handed to the awaiting request, whatever it is
                result, error = None, exc
            self._ended(state, error is None)
            loop.call_soon_threadsafe(_settle, future, result, error)

        threading.Thread(target=run, name=f"vae-sink-{self.name}", daemon=True).start()
        return future, state

    def abandon(self, writes: list[_Write]) -> None:
        """The request stopped waiting for these: the unfinished ones free their slots and count as
        stuck until their threads end."""
        with self._lock:
            for state in writes:
                if not state.done and not state.abandoned:
                    state.abandoned = True
                    self.in_flight -= 1
                    self.stuck += 1

    def _ended(self, state: _Write, ok: bool) -> None:
        with self._lock:
            state.done = True
            if state.abandoned:
                self.stuck -= 1
            else:
                self.in_flight -= 1
            if ok:
                self.written += 1
            else:
                self.failed += 1

    def describe(self) -> dict:
        with self._lock:
            return {
                "capacity": self.capacity,
                "in_flight": self.in_flight,
                "stuck": self.stuck,
                "written": self.written,
                "failed": self.failed,
                "refused": self.refused,
            }


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # its request stopped waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
