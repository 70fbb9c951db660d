"""Tier-keyed dynamic batching, free of Ray: the Serve deployment and the tests drive it alike.

- One queue per batch key (tier, latent shape, dtype, ...); a batch never mixes keys.
- Fair: the next batch always starts with the oldest waiting item of any key, so a steady
  stream of one key cannot starve another and every item's wait is bounded.
- A batch fills up to `max_batch_size` items (a request with batch dim B counts B) or waits at
  most `batch_wait_ms` after its oldest item arrived.
- Device work is serialised: one batch runs at a time, in a worker thread (the caller's
  executor, e.g. one dedicated device thread).
- A request whose caller went away or whose deadline passed is dropped before decode; a batch
  whose callers have all gone is told so while it runs.
- A failing batch is retried item by item, so one bad request fails alone.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar


class Batchable(Protocol):
    @property
    def batch_key(self) -> Hashable: ...

    @property
    def items(self) -> int: ...


T = TypeVar("T", bound=Batchable)


class QueueFull(Exception):
    """Too many items waiting: the caller should back off (429 + Retry-After)."""

    def __init__(self, waiting: int, limit: int, retry_after_s: float):
        super().__init__(f"{waiting} items waiting, limit {limit}")
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The request's deadline passed before its result was ready (504)."""


@dataclass
class BatchStats:
    key: Hashable
    requests: list  # as submitted, in batch order
    items: int
    queue_s: list[float]
    started: float  # batcher clock when the batch left its queue
    run_s: float


@dataclass(eq=False)
class _Pending(Generic[T]):
    request: T
    future: asyncio.Future
    arrived: float
    deadline: float | None
    caller: asyncio.Task | None = None

    def live(self, now: float) -> bool:
        # a cancel request reaches the caller's coroutine only at its next step: look at the task
        # too, so that work whose caller has already gone is never started
        caller_gone = self.caller is not None and (self.caller.done() or self.caller.cancelling() > 0)
        return not (self.future.done() or caller_gone) and (self.deadline is None or now < self.deadline)


@dataclass
class BatcherLimits:
    max_batch_size: int = 8
    batch_wait_ms: float = 0.0
    max_queued_items: int = 256
    retry_after_s: float = 1.0  # what a caller refused for a full queue is told to wait


@dataclass
class KeyedBatcher(Generic[T]):
    """`run_batch(requests, abandoned) -> results` (one per request, an Exception instance fails just
    that request) runs in a worker thread; `abandoned` (a threading.Event) is set once every caller
    of the batch has timed out or gone away, so long work can stop at its next step.
    `on_batch(stats)` observes each batch (metrics)."""

    run_batch: Callable[[list[T]], list[Any]]
    limits: BatcherLimits = field(default_factory=BatcherLimits)
    on_batch: Callable[[BatchStats], None] | None = None
    clock: Callable[[], float] = time.monotonic
    executor: Executor | None = None  # where batches run (default: the loop's default executor)
    _queues: dict[Hashable, collections.deque] = field(default_factory=dict, init=False)
    _wakeup: asyncio.Event | None = field(default=None, init=False)
    _worker: asyncio.Task | None = field(default=None, init=False)
    _running: int = field(default=0, init=False)

    # ---- submitting -------------------------------------------------------------------------
    async def submit(self, request: T, timeout_s: float | None = None) -> Any:
        waiting = self.queued_items()
        if waiting + request.items > self.limits.max_queued_items:
            raise QueueFull(waiting, self.limits.max_queued_items, self._retry_after())
        self._ensure_worker()
        now = self.clock()
        pending = _Pending(
            request,
            asyncio.get_running_loop().create_future(),
            now,
            None if timeout_s is None else now + timeout_s,
            asyncio.current_task(),
        )
        self._queues.setdefault(request.batch_key, collections.deque()).append(pending)
        self._wakeup.set()
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(f"no result within {timeout_s:.3g} s") from None
        finally:
            if not pending.future.done():  # cancelled or timed out: never decode it
                pending.future.cancel()

    def queued_items(self, key_filter: Callable[[Hashable], bool] | None = None) -> int:
        return sum(
            p.request.items
            for k, q in self._queues.items()
            if key_filter is None or key_filter(k)
            for p in q
            if not p.future.done()
        )

    @property
    def running(self) -> int:
        """Batches on the device now (0 or 1)."""
        return self._running

    def _queued_for(self, key: Hashable) -> int:
        return sum(p.request.items for p in self._queues.get(key, ()) if not p.future.done())

    def update(self, limits: BatcherLimits) -> None:
        self.limits = limits
        if self._wakeup is not None:
            self._wakeup.set()

    async def close(self) -> None:
        """Stop the worker (after `drain`); queued requests are cancelled."""
        if self._worker is not None:
            self._worker.cancel()
            for queue in self._queues.values():
                for pending in queue:
                    pending.future.cancel()
            self._queues.clear()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running (graceful shutdown); False on timeout."""
        end = self.clock() + timeout_s
        while self.queued_items() or self._running:
            if self.clock() >= end:
                return False
            await asyncio.sleep(0.01)
        return True

    # ---- the worker -------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work())

    def _retry_after(self) -> float:
        return self.limits.retry_after_s

    def _oldest_head(self) -> tuple[Hashable, _Pending] | None:
        now = self.clock()
        best = None
        for key, queue in list(self._queues.items()):
            while queue and not queue[0].live(now):
                self._discard(queue.popleft())
            if not queue:
                del self._queues[key]
            elif best is None or queue[0].arrived < best[1].arrived:
                best = (key, queue[0])
        return best

    @staticmethod
    def _discard(pending: _Pending) -> None:
        """Drop an item that will not be decoded: tell a still-waiting caller its deadline passed."""
        if not pending.future.done():
            caller_gone = pending.caller is not None and (pending.caller.done() or pending.caller.cancelling())
            if caller_gone:
                pending.future.cancel()
            else:
                pending.future.set_exception(DeadlineExceeded("deadline passed while queued"))

    def _take(self, key: Hashable) -> list[_Pending]:
        now, queue, batch, items = self.clock(), self._queues.get(key, collections.deque()), [], 0
        while queue:
            head = queue[0]
            if not head.live(now):
                self._discard(queue.popleft())
                continue
            if batch and items + head.request.items > self.limits.max_batch_size:
                break
            batch.append(queue.popleft())
            items += head.request.items
        if not queue:
            self._queues.pop(key, None)
        return batch

    async def _work(self) -> None:
        while True:
            chosen = self._oldest_head()
            if chosen is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            key, head = chosen
            remaining = head.arrived + self.limits.batch_wait_ms / 1e3 - self.clock()
            if remaining > 0 and self._queued_for(key) < self.limits.max_batch_size:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    pass
                continue  # re-evaluate: the queue may have filled, or an older key arrived
            batch = self._take(key)
            if batch:
                await self._run(key, batch)

    async def _run(self, key: Hashable, batch: list[_Pending]) -> None:
        self._running += 1
        started = self.clock()
        abandoned = threading.Event()  # every caller of the batch went away: the work may stop early
        watcher = asyncio.get_running_loop().create_task(self._watch_callers(batch, abandoned))
        try:
            results = await self._decode_isolating_failures([p.request for p in batch], abandoned)
        finally:
            self._running -= 1
            watcher.cancel()
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():
                continue  # the caller gave up meanwhile
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
        if self.on_batch is not None:
            self.on_batch(
                BatchStats(
                    key,
                    [p.request for p in batch],
                    sum(p.request.items for p in batch),
                    [started - p.arrived for p in batch],
                    started,
                    self.clock() - started,
                )
            )

    @staticmethod
    async def _watch_callers(batch: list[_Pending], abandoned: threading.Event) -> None:
        """A caller's future is done before its result only when it timed out or went away."""
        await asyncio.wait([p.future for p in batch])
        abandoned.set()

    def _in_executor(self, requests: list[T], abandoned: threading.Event) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.executor, self.run_batch, requests, abandoned)

    async def _decode_isolating_failures(self, requests: list[T], abandoned: threading.Event) -> list[Any]:
        try:
            return _one_each(requests, await self._in_executor(requests, abandoned))
        except Exception as exc:
            if len(requests) == 1 or abandoned.is_set():
                return [exc] * len(requests)
        results = []
        for request in requests:  # the batch failed as a whole: each request gets one try alone
            try:
                results.extend(_one_each([request], await self._in_executor([request], abandoned)))
            except Exception as exc:
                results.append(exc)
        return results


def _one_each(requests: list, results: list) -> list:
    """A runner answering more or fewer results than requests is a bug: fail those requests
    loudly instead of leaving some callers waiting forever."""
    if len(results) != len(requests):
        raise RuntimeError(f"the batch runner answered {len(results)} results for {len(requests)} requests")
    return results
