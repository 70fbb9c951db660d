"""One replica's device, scheduled step by step across priority classes; free of Ray (the Serve
deployment and the tests drive it alike).

Queues and batches (the batcher's rules, inside each class):
- One queue per (class, batch key); a batch never mixes classes, tiers or keys, and fills up to
  `max_batch_size` items (a request with batch dim B counts B) or waits at most `batch_wait_ms`
  after its oldest item arrived while the device is idle.
- Each class has its own waiting bound (`QueueFull` names the class): a flood of one class never
  refuses another's work.
- A request whose caller went away or whose deadline passed is dropped before decode; a batch whose
  callers have all gone is told so while it runs. A failing batch is retried item by item.

Steps (serving/scheduling/device_turns.py): a started batch runs on a device thread of its own, but
the device runs one step at a time (an image decoder call, one latent frame of a video walk, a
tile); between two steps the engine asks `DeviceTurns` whether more urgent work waits, and if so it
is suspended there, its state (the walk's cache, finished tiles, frames already streamed) kept on
its thread, until it is the most urgent again. Urgency: class first (after promotion: one class
more urgent for each `promote_after_s` waited), then the earliest deadline, then age.

The next batch starts while others are started only when it is more urgent than all of them
(preemption), at most `max_suspended` would be suspended, and memory stays planned: every
started batch's peak beside what all the others hold between steps fits the decode bound, and what
suspended batches hold fits `suspended_bytes`. Otherwise it waits in its queue (counted as
`waited_for_room`). With preemption off the device runs one batch at a time, to completion.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from vae_service.serving.scheduling.classes import INTERACTIVE, RANK, promoted
from vae_service.serving.scheduling.device_turns import DeviceTurns, StepPrice, Turn
from vae_service.serving.scheduling.wait_stats import ClassStats


class Batchable(Protocol):
    @property
    def batch_key(self) -> Hashable: ...

    @property
    def items(self) -> int: ...


T = TypeVar("T", bound=Batchable)


class QueueFull(Exception):
    """Too many items of one class waiting: the caller should back off (429 + Retry-After)."""

    def __init__(self, priority: str, waiting: int, limit: int, retry_after_s: float):
        super().__init__(f"{waiting} {priority} items waiting, limit {limit}")
        self.priority, self.retry_after_s = priority, retry_after_s


class NeverFits(Exception):
    """More items than a class's queue ever holds (413)."""

    def __init__(self, priority: str, items: int, limit: int):
        super().__init__(f"{items} items are more than the {priority} queue ever holds ({limit})")
        self.priority = priority


class DeadlineExceeded(Exception):
    """The request's deadline passed before its result was ready (504)."""


@dataclass
class BatchStats:
    key: Hashable
    requests: list  # as submitted, in batch order
    items: int
    queue_s: list[float]
    started: float  # scheduler clock when the batch left its queue
    run_s: float
    priority: str = INTERACTIVE
    preempted_s: float = 0.0  # time it spent suspended between its steps
    steps: int = 1
    preemptions: int = 0
    promotions: int = 0  # classes it rose while it waited (queued or suspended)


@dataclass(eq=False)
class _Pending(Generic[T]):
    request: T
    priority: str
    future: asyncio.Future
    arrived: float
    deadline: float | None
    caller: asyncio.Task | None = None
    price: StepPrice = field(default_factory=lambda: StepPrice(0, 0))  # its share of a batch's price
    waited_for_room: bool = False  # counted once

    def live(self, now: float) -> bool:
        # a cancel request reaches the caller's coroutine only at its next step: look at the task
        # too, so that work whose caller has already gone is never started
        caller_gone = self.caller is not None and (self.caller.done() or self.caller.cancelling() > 0)
        return not (self.future.done() or caller_gone) and (self.deadline is None or now < self.deadline)


@dataclass
class SchedulerLimits:
    max_batch_size: int = 8
    batch_wait_ms: float = 0.0
    max_queued_items: int = 256  # a class's waiting bound unless `queued_items` names it
    retry_after_s: float = 1.0  # what a caller refused for a full queue is told to wait
    queued_items: dict[str, int] = field(default_factory=dict)
    preemption: bool = True
    promote_after_s: float = 15.0
    max_suspended: int = 2
    decode_bound: int | None = None  # bytes one decode may use at its peak (None: not planned here)
    suspended_bytes: int | None = None  # room for suspended decodes' state (None: a quarter of the bound)

    def class_bound(self, priority: str) -> int:
        return self.queued_items.get(priority, self.max_queued_items)

    @property
    def suspended_room(self) -> int | None:
        if self.suspended_bytes is not None:
            return self.suspended_bytes
        return None if self.decode_bound is None else self.decode_bound // 4


@dataclass(eq=False)
class _Job:
    """A started batch (or a tile another replica sent): its turn on the device, and its price."""

    key: Hashable
    priority: str
    arrived: float
    deadline: float | None
    price: StepPrice
    turn: Turn = None
    order: int = 0
    queued_s: float = 0.0  # its oldest request's wait in the queue
    items: int = 1

    def waited_s(self, now: float) -> float:
        """Time it waited for the device (queued, or suspended): what promotes it, never its run."""
        return self.queued_s + self.turn.waited_s(now)


@dataclass
class StepScheduler(Generic[T]):
    """`run_batch(requests, abandoned, turn) -> results` (one per request, an Exception instance
    fails just that request) runs in a device thread; `abandoned` (a threading.Event) is set once
    every caller of the batch has timed out or gone away; `turn` is the batch's place on the device
    (the engine calls its `between_steps` at every step boundary). `price(request)`: a request's
    StepPrice (the peak of its decode, what it holds while suspended), asked once, at submit; a
    batch's is their sum. `on_batch(stats)` observes each batch (metrics)."""

    run_batch: Callable[[list[T], threading.Event, Turn], list[Any]]
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    on_batch: Callable[[BatchStats], None] | None = None
    clock: Callable[[], float] = time.monotonic
    executor: Executor | None = None  # device threads (one per started batch at most)
    price: Callable[[T], StepPrice] = lambda request: StepPrice(0, 0)
    _queues: dict[tuple[str, Hashable], collections.deque] = field(default_factory=dict, init=False)
    _wakeup: asyncio.Event | None = field(default=None, init=False)
    _worker: asyncio.Task | None = field(default=None, init=False)
    _started: list[_Job] = field(default_factory=list, init=False)
    _order: itertools.count = field(default_factory=itertools.count, init=False)

    def __post_init__(self) -> None:
        self.turns = DeviceTurns(self._urgency, self.clock, self._may_suspend)
        self.stats = ClassStats(self.clock)

    # ---- submitting -------------------------------------------------------------------------
    async def submit(self, request: T, timeout_s: float | None = None, priority: str = INTERACTIVE) -> Any:
        waiting, bound = self.queued_items(priority), self.limits.class_bound(priority)
        if request.items > bound:
            raise NeverFits(priority, request.items, bound)
        if waiting + request.items > bound:
            self.stats.refused(priority)
            raise QueueFull(priority, waiting, bound, self.limits.retry_after_s)
        self._ensure_worker()
        now = self.clock()
        pending = _Pending(
            request,
            priority,
            asyncio.get_running_loop().create_future(),
            now,
            None if timeout_s is None else now + timeout_s,
            asyncio.current_task(),
            self.price(request),  # here, where a failure is its caller's: never in the worker
        )
        self._queues.setdefault((priority, request.batch_key), collections.deque()).append(pending)
        self._wakeup.set()
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), timeout_s)
        except TimeoutError:
            # the decode's own answer when it has one: its own TimeoutError (a peer's, a socket's), or
            # an answer its device thread set while this wait was timing out (its deadline, seen
            # between steps): never a bare TimeoutError from the wait that no caller maps to 504
            if pending.future.done() and not pending.future.cancelled():
                return pending.future.result()
            raise DeadlineExceeded(f"no result within {timeout_s:.3g} s") from None
        finally:
            if not pending.future.done():  # cancelled or timed out: never decode it
                pending.future.cancel()

    def queued_items(self, priority: str | None = None, key_filter: Callable[[Hashable], bool] | None = None) -> int:
        return sum(
            p.request.items
            for (cls, key), q in self._queues.items()
            if (priority is None or cls == priority) and (key_filter is None or key_filter(key))
            for p in q
            if not p.future.done()
        )

    def oldest_wait_s(self, priority: str) -> float:
        """How long the class's oldest live queued request has waited so far (0 with none): a wait
        the started batches' figures cannot show while the device keeps it waiting."""
        now = self.clock()
        queues = [q for (cls, _), q in self._queues.items() if cls == priority]
        return now - min((next((p.arrived for p in q if p.live(now)), now) for q in queues), default=now)

    def started_items(self, priority: str) -> int:
        return sum(job.items for job in self._started if job.priority == priority)

    @property
    def running(self) -> int:
        """Batches started and not finished: the one on the device and those suspended."""
        return len(self._started)

    def suspended_bytes(self) -> int:
        holder = self.turns.holder
        return sum(job.price.held for job in self._started if job.turn is not holder)

    def update(self, limits: SchedulerLimits) -> None:
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
        while self.queued_items() or self._started:
            if self.clock() >= end:
                return False
            await asyncio.sleep(0.01)
        return True

    # ---- work that bypasses the queues: another replica's tile ------------------------------
    async def run_alone(self, work: Callable[[Turn], Any], priority: str, deadline: float, price: StepPrice) -> Any:
        """`work(turn)` on a device thread as a started batch of its own (a tile another replica
        offered while this one was idle): it takes turns with the rest, step by step."""
        job = _Job(("tile",), priority, self.clock(), deadline, price, order=next(self._order))
        job.turn = self.turns.turn(job)
        self._started.append(job)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, self._on_device, job, work)
        finally:
            self._finished(job)

    # ---- choosing -----------------------------------------------------------------------------
    def _urgency(self, job: _Job) -> tuple:
        return self._key(job.priority, job.waited_s(self.clock()), job.deadline, job.arrived, job.order)

    def _head_key(self, pending: _Pending) -> tuple:
        # last among equals: a queued request never starts beside a started batch just as urgent
        return self._key(pending.priority, self.clock() - pending.arrived, pending.deadline, pending.arrived, math.inf)

    def _key(self, priority: str, waited_s: float, deadline: float | None, arrived: float, order: float) -> tuple:
        cls = promoted(priority, waited_s, self.limits.promote_after_s)
        return (RANK[cls], float("inf") if deadline is None else deadline, arrived, order)

    def _most_urgent_head(self) -> tuple[tuple[str, Hashable], _Pending] | None:
        now = self.clock()
        best = None
        for qkey, queue in list(self._queues.items()):
            while queue and not queue[0].live(now):
                self._discard(queue.popleft())
            if not queue:
                del self._queues[qkey]
            elif best is None or self._head_key(queue[0]) < self._head_key(best[1]):
                best = (qkey, queue[0])
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

    def _queued_for(self, qkey: tuple[str, Hashable]) -> int:
        return sum(p.request.items for p in self._queues.get(qkey, ()) if not p.future.done())

    def _take(self, qkey: tuple[str, Hashable]) -> list[_Pending]:
        now, queue, batch, items = self.clock(), self._queues.get(qkey, collections.deque()), [], 0
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
            self._queues.pop(qkey, None)
        return batch

    def _may_start_beside(self, head: _Pending, price: StepPrice) -> bool:
        """Whether a batch may start while others are started: more urgent than every one of them,
        a free place among the suspended, and memory planned (every started batch's peak beside
        what all the others hold fits the bound; the suspended ones' state fits their room)."""
        limits = self.limits
        if not limits.preemption or len(self._started) > limits.max_suspended:
            return False
        if any(self._head_key(head) >= self._urgency(job) for job in self._started):
            return False
        prices = [job.price for job in self._started] + [price]
        held = sum(p.held for p in prices)
        if limits.decode_bound is not None and max(p.peak - p.held for p in prices) + held > limits.decode_bound:
            return False
        room = limits.suspended_room
        return room is None or held - price.held <= room

    # ---- the worker -------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work())

    async def _sleep(self, timeout_s: float | None) -> None:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout_s)
        except TimeoutError:
            pass

    async def _work(self) -> None:
        while True:
            chosen = self._most_urgent_head()
            if chosen is None:
                await self._sleep(None)
                continue
            qkey, head = chosen
            if self._started:
                price = self._batch_price(self._peek_batch(qkey))
                if not self._may_start_beside(head, price):
                    if self.limits.preemption and self._more_urgent_than_started(head) and not head.waited_for_room:
                        head.waited_for_room = True
                        self.stats.waited_for_room(head.priority)
                    # promotion and deadlines change with time: look again a little later
                    await self._sleep(0.05)
                    continue
            else:
                remaining = head.arrived + self.limits.batch_wait_ms / 1e3 - self.clock()
                if remaining > 0 and self._queued_for(qkey) < self.limits.max_batch_size:
                    await self._sleep(remaining)
                    continue  # re-evaluate: the queue may have filled, or a more urgent key arrived
            batch = self._take(qkey)
            if batch:
                self._start(qkey, batch)

    def _may_suspend(self, holder: _Job, successor: _Job) -> bool:
        """Promotion may let a suspended batch overtake the one that preempted it: the one then
        suspended must fit the room too (what every started batch but the successor holds)."""
        room = self.limits.suspended_room
        return room is None or sum(j.price.held for j in tuple(self._started) if j is not successor) <= room

    def _more_urgent_than_started(self, head: _Pending) -> bool:
        return all(self._head_key(head) < self._urgency(job) for job in self._started)

    @staticmethod
    def _batch_price(batch: list[_Pending]) -> StepPrice:
        return StepPrice(sum(p.price.peak for p in batch), sum(p.price.held for p in batch))

    def _peek_batch(self, qkey: tuple[str, Hashable]) -> list[_Pending]:
        batch, items, now = [], 0, self.clock()
        for pending in self._queues.get(qkey, ()):
            if not pending.live(now):
                continue
            if batch and items + pending.request.items > self.limits.max_batch_size:
                break
            batch.append(pending)
            items += pending.request.items
        return batch

    def _start(self, qkey: tuple[str, Hashable], batch: list[_Pending]) -> None:
        priority, key = qkey
        deadlines = [p.deadline for p in batch if p.deadline is not None]
        arrived = min(p.arrived for p in batch)
        job = _Job(
            key,
            priority,
            arrived,
            min(deadlines, default=None),
            self._batch_price(batch),
            order=next(self._order),
            queued_s=self.clock() - arrived,
            items=sum(p.request.items for p in batch),
        )
        job.turn = self.turns.turn(job)
        self._started.append(job)
        self.stats.started(priority, [self.clock() - p.arrived for p in batch])
        asyncio.get_running_loop().create_task(self._run(job, batch))

    def _finished(self, job: _Job) -> int:
        """Its promotions: the classes it rose while it waited."""
        self._started.remove(job)
        after = promoted(job.priority, job.waited_s(self.clock()), self.limits.promote_after_s)
        promotions = RANK[job.priority] - RANK[after]
        self.stats.finished(job.priority, job.turn, promotions, job.items)
        if self._wakeup is not None:
            self._wakeup.set()
        return promotions

    async def _run(self, job: _Job, batch: list[_Pending]) -> None:
        started = self.clock()
        abandoned = threading.Event()  # every caller of the batch went away: the work may stop early
        watcher = asyncio.get_running_loop().create_task(self._watch_callers(batch, abandoned))
        promotions = 0
        try:
            results = await self._decode_isolating_failures(job, [p.request for p in batch], abandoned)
        finally:
            watcher.cancel()
            promotions = self._finished(job)
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
                    job.key,
                    [p.request for p in batch],
                    sum(p.request.items for p in batch),
                    [started - p.arrived for p in batch],
                    started,
                    self.clock() - started,
                    job.priority,
                    job.turn.suspended_s,
                    job.turn.steps + 1 if job.turn.ran else 0,
                    job.turn.preemptions,
                    promotions,
                )
            )

    @staticmethod
    async def _watch_callers(batch: list[_Pending], abandoned: threading.Event) -> None:
        """A caller's future is done before its result only when it timed out or went away."""
        await asyncio.wait([p.future for p in batch])
        abandoned.set()

    def _on_device(self, job: _Job, work: Callable[[Turn], Any]) -> Any:
        """On a device thread: wait for the batch's first turn, run it, give the device back."""
        job.turn.take()
        try:
            return work(job.turn)
        finally:
            job.turn.release()

    def _in_executor(self, job: _Job, requests: list[T], abandoned: threading.Event) -> asyncio.Future:
        job.turn.watch(abandoned)

        def work(turn: Turn) -> list:
            return self.run_batch(requests, abandoned, turn)

        return asyncio.get_running_loop().run_in_executor(self.executor, self._on_device, job, work)

    async def _decode_isolating_failures(self, job: _Job, requests: list[T], abandoned: threading.Event) -> list:
        try:
            return _one_each(requests, await self._in_executor(job, requests, abandoned))
        except Exception as exc:
            if len(requests) == 1 or abandoned.is_set():
                return [exc] * len(requests)
        results = []
        for request in requests:  # the batch failed as a whole: each request gets one try alone
            try:
                results.extend(_one_each([request], await self._in_executor(job, [request], abandoned)))
            except Exception as exc:
                results.append(exc)
        return results


def _one_each(requests: list, results: list) -> list:
    """A runner answering more or fewer results than requests is a bug: fail those requests
    loudly instead of leaving some callers waiting forever."""
    if len(results) != len(requests):
        raise RuntimeError(f"the batch runner answered {len(results)} results for {len(requests)} requests")
    return results
