"""The step scheduler across priority classes, without Ray: preemption between steps, room for
suspended work, promotion, per-class queue bounds, abandonment and the scheduler's statistics.

The fake decoder is a "stepper": each request says how many steps it has and how long one takes;
the runner records every step it runs and calls `turn.between_steps` between two steps, where the
scheduler may suspend it for more urgent work. Orderings are made deterministic with gates (a step
held, the device with it, until the test opens it) rather than sleeps: the only waits on the clock
are generous timeouts that turn a hang into a failure."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vae_service.config import Scheduling
from vae_service.engine.request.errors import InvalidInput
from vae_service.names import PRIORITIES
from vae_service.serving.scheduling import device_turns
from vae_service.serving.scheduling.classes import (
    BULK,
    INTERACTIVE,
    RANK,
    REALTIME,
    promoted,
    request_class,
    session_class,
)
from vae_service.serving.scheduling.device_turns import StepPrice
from vae_service.serving.scheduling.scheduler import DeadlineExceeded, QueueFull, SchedulerLimits, StepScheduler

pytestmark = pytest.mark.timeout(60)

STEP_S = 0.01
HANG_S = 10.0  # a gate or a condition not reached in this long is a hang, not a slow machine
SETTLE_S = 0.1  # the worker looks at a new request at once, then every 50 ms: two looks at least


class Stopped(Exception):
    """The runner's check: every caller of its batch went away."""


@dataclass(frozen=True)
class Stepped:
    """A request of `steps` device steps of `step_s` each, priced `peak` (while it runs a step)
    and `held` (between two steps)."""

    name: str
    cls: str = BULK
    steps: int = 3
    step_s: float = STEP_S
    peak: int = 0
    held: int = 0
    timeout_s: float | None = None
    key: str | None = None  # None: a batch of its own
    items: int = 1

    @property
    def batch_key(self):
        return self.key or self.name

    @property
    def answer(self) -> tuple:
        """What the stepper answers when it ran every step once, in order."""
        return ("done", self.name, tuple(range(self.steps)))


class Step(NamedTuple):
    name: str
    index: int
    cls: str
    at: float


class Gate:
    """Holds a request inside one of its steps (the device held with it) until the test opens it."""

    def __init__(self):
        self.reached, self.opened = threading.Event(), threading.Event()

    def pass_through(self) -> None:
        self.reached.set()
        if not self.opened.wait(3 * HANG_S):  # longer than a test's own waits: its failure says why
            raise TimeoutError("a gate was never opened")

    def open(self) -> None:
        self.opened.set()


class Stepper:
    """The fake runner. At every step it also checks what the scheduler must guarantee: the step's
    batch holds the device, no other step runs at the same time, and the memory plan holds (its
    peak beside what the suspended batches hold fits the decode bound; their state fits its room)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.trace: list[Step] = []
        self.stopped: list[str] = []  # requests whose check raised: their callers left
        self.gates: dict[tuple[str, int], Gate] = {}
        self.inside = self.most_inside = 0
        # turn -> price of every batch inside the runner: those suspended hold their state
        self.live: dict[object, StepPrice] = {}
        self.violations: list[str] = []
        self.scheduler: StepScheduler | None = None
        self.executors: list[ThreadPoolExecutor] = []

    @staticmethod
    def price(request: Stepped) -> StepPrice:
        """The scheduler asks each request's price; a batch's is their sum."""
        return StepPrice(request.peak, request.held)

    @classmethod
    def batch_price(cls, batch) -> StepPrice:
        return StepPrice(sum(cls.price(r).peak for r in batch), sum(cls.price(r).held for r in batch))

    def hold(self, name: str, step: int) -> Gate:
        gate = self.gates[(name, step)] = Gate()
        return gate

    def order(self) -> list[tuple[str, int]]:
        with self.lock:
            return [(s.name, s.index) for s in self.trace]

    def steps_of(self, name: str) -> list[int]:
        return [index for n, index in self.order() if n == name]

    def shutdown(self) -> None:
        for gate in self.gates.values():  # a failed test leaves no runner waiting at a gate
            gate.open()
        for executor in self.executors:
            executor.shutdown(wait=True, cancel_futures=True)

    def __call__(self, batch, abandoned: threading.Event, turn):
        ran = {r.name: [] for r in batch}

        def check():
            if abandoned.is_set():
                with self.lock:
                    self.stopped.extend(r.name for r in batch)
                raise Stopped("every caller left")

        with self.lock:
            self.live[turn] = self.batch_price(batch)
        try:
            for index in range(max(r.steps for r in batch)):
                if index:
                    turn.between_steps(check)
                members = [r for r in batch if index < r.steps]
                self._step(members, index, turn)
                for r in members:
                    ran[r.name].append(index)
        finally:
            with self.lock:
                del self.live[turn]
        return [("done", r.name, tuple(ran[r.name])) for r in batch]

    def _step(self, members, index, turn) -> None:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.trace.extend(Step(r.name, index, r.cls, time.monotonic()) for r in members)
            gates = [self.gates[(r.name, index)] for r in members if (r.name, index) in self.gates]
        try:
            self._check_plan(turn)
            for gate in gates:
                gate.pass_through()
            time.sleep(max(r.step_s for r in members))
        finally:
            with self.lock:
                self.inside -= 1

    def _check_plan(self, turn) -> None:
        scheduler = self.scheduler
        with scheduler.turns._cond:  # no turn changes hands while we look
            holder = scheduler.turns.holder
            started = {job.turn for job in scheduler._started}
            with self.lock:
                live = dict(self.live)
        limits, problems = scheduler.limits, []
        if holder is not turn:
            problems.append("a step ran without holding the device")
        if not set(live) <= started:
            problems.append("a batch inside its runner is missing from the scheduler's started batches")
        suspended = [price for t, price in live.items() if t is not turn]
        held = sum(price.held for price in suspended)
        if len(suspended) > limits.max_suspended:
            problems.append(f"{len(suspended)} batches suspended, at most {limits.max_suspended}")
        if limits.decode_bound is not None and live[turn].peak + held > limits.decode_bound:
            problems.append(f"peak {live[turn].peak} beside {held} held exceeds the bound {limits.decode_bound}")
        if limits.suspended_room is not None and held > limits.suspended_room:
            problems.append(f"suspended batches hold {held}, room {limits.suspended_room}")
        if problems:
            with self.lock:
                self.violations.extend(problems)


@pytest.fixture
def stepper():
    stepper = Stepper()
    yield stepper
    stepper.shutdown()


def make_scheduler(stepper: Stepper, limits: SchedulerLimits | None = None, **kwargs) -> StepScheduler:
    limits = limits or SchedulerLimits()
    # one device thread per started batch: the running one and every suspended one, and a spare
    executor = ThreadPoolExecutor(limits.max_suspended + 2, thread_name_prefix="device")
    stepper.executors.append(executor)
    stepper.scheduler = StepScheduler(stepper, limits, executor=executor, price=stepper.price, **kwargs)
    return stepper.scheduler


def submit(scheduler: StepScheduler, request: Stepped):
    return scheduler.submit(request, request.timeout_s, request.cls)


async def until(condition, what: str) -> None:
    end = time.monotonic() + HANG_S
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def finish(scheduler: StepScheduler, stepper: Stepper) -> None:
    assert await scheduler.drain(HANG_S)
    await scheduler.close()
    assert stepper.violations == []
    assert stepper.most_inside == 1


async def second_arrives_while_first_runs(scheduler, stepper, first, second, *, held_at=2, preempts=True):
    """`first` runs and is held inside its step `held_at` while `second` arrives. The gate opens
    once `second` waits for the device (it was started to preempt: the boundary after that step
    gives way) or, where it should not preempt, once the worker had time to wrongly start it.
    Answers both callers' answers and how many batches were started while `first` was held."""
    gate = stepper.hold(first.name, held_at)
    first_call = asyncio.create_task(submit(scheduler, first))
    await until(gate.reached.is_set, f"{first.name} reaching its step {held_at}")
    second_call = asyncio.create_task(submit(scheduler, second))
    if preempts:
        await until(lambda: scheduler.turns.waiting == 1, f"{second.name} waiting for the device")
    else:
        await until(lambda: scheduler.queued_items() == 1, f"{second.name} queued")
        await asyncio.sleep(SETTLE_S)
    started_while_held = scheduler.running
    gate.open()
    answers = await asyncio.wait_for(asyncio.gather(first_call, second_call), HANG_S)
    return answers, started_while_held


def preempted_order(first: Stepped, second: Stepped, held_at: int = 2) -> list[tuple[str, int]]:
    """`first` up to the step in progress, every step of `second`, then the rest of `first`."""
    return (
        [(first.name, i) for i in range(held_at + 1)]
        + [(second.name, i) for i in range(second.steps)]
        + [(first.name, i) for i in range(held_at + 1, first.steps)]
    )


def one_after_another(*requests: Stepped) -> list[tuple[str, int]]:
    return [(r.name, i) for r in requests for i in range(r.steps)]


# ---- 1. preemption between steps -----------------------------------------------------------------
@pytest.mark.parametrize(
    "running, urgent",
    [
        (Stepped("running", BULK, 6), Stepped("urgent", REALTIME, 3)),
        (Stepped("running", BULK, 6), Stepped("urgent", INTERACTIVE, 3)),
        (Stepped("running", INTERACTIVE, 6), Stepped("urgent", REALTIME, 3)),
        # same class: the earlier deadline is the more urgent
        (Stepped("running", BULK, 6, timeout_s=60), Stepped("urgent", BULK, 3, timeout_s=30)),
    ],
    ids=["realtime-over-bulk", "interactive-over-bulk", "realtime-over-interactive", "earlier-deadline"],
)
async def test_more_urgent_work_runs_every_step_before_the_running_batchs_next_one(stepper, running, urgent):
    scheduler = make_scheduler(stepper)
    answers, started = await second_arrives_while_first_runs(scheduler, stepper, running, urgent)
    assert started == 2
    # the running batch resumes at the step after the one in progress: none repeated or skipped
    assert stepper.order() == preempted_order(running, urgent)
    assert answers == [running.answer, urgent.answer]
    await finish(scheduler, stepper)


@pytest.mark.parametrize(
    "running, later",
    [
        (Stepped("running", BULK, 6, timeout_s=30), Stepped("later", BULK, 3, timeout_s=60)),
        (Stepped("running", INTERACTIVE, 6), Stepped("later", INTERACTIVE, 3)),
        (Stepped("running", REALTIME, 6), Stepped("later", BULK, 3)),
    ],
    ids=["same-class-later-deadline", "same-class-younger", "less-urgent-class"],
)
async def test_work_no_more_urgent_than_the_running_batch_waits_for_it(stepper, running, later):
    scheduler = make_scheduler(stepper)
    answers, started = await second_arrives_while_first_runs(scheduler, stepper, running, later, preempts=False)
    assert started == 1
    assert stepper.order() == one_after_another(running, later)
    assert answers == [running.answer, later.answer]
    await finish(scheduler, stepper)


# ---- 2. preemption off --------------------------------------------------------------------------
async def test_without_preemption_the_running_batch_finishes_then_the_most_urgent_class_goes(stepper):
    scheduler = make_scheduler(stepper, SchedulerLimits(preemption=False))
    running = Stepped("running", BULK, 5)
    bulk, interactive, realtime = Stepped("bulk", BULK, 2), Stepped("inter", INTERACTIVE, 2), Stepped("rt", REALTIME, 2)
    gate = stepper.hold(running.name, 1)
    calls = [asyncio.create_task(submit(scheduler, running))]
    await until(gate.reached.is_set, "the running batch's step 1")
    calls += [asyncio.create_task(submit(scheduler, r)) for r in (bulk, interactive, realtime)]  # least urgent first
    await until(lambda: scheduler.queued_items() == 3, "three queued requests")
    await asyncio.sleep(SETTLE_S)
    started_while_held = scheduler.running
    gate.open()
    answers = await asyncio.wait_for(asyncio.gather(*calls), HANG_S)

    assert started_while_held == 1
    assert stepper.order() == one_after_another(running, realtime, interactive, bulk)
    assert answers == [r.answer for r in (running, bulk, interactive, realtime)]
    assert scheduler.stats.describe()[REALTIME]["waited_for_room"] == 0  # it waited for its turn, not for room
    await finish(scheduler, stepper)


# ---- 3. room for suspended work ---------------------------------------------------------------
@pytest.mark.parametrize(
    "limits, running_price, urgent_price, preempts",
    [
        (SchedulerLimits(max_suspended=0), (0, 0), (0, 0), False),
        (SchedulerLimits(decode_bound=1000, suspended_bytes=50), (100, 100), (10, 10), False),
        (SchedulerLimits(decode_bound=400), (150, 150), (10, 10), False),  # the default room: a quarter of the bound
        # the urgent step's peak (60) beside what the running batch holds (50) exceeds the bound
        (SchedulerLimits(decode_bound=100, suspended_bytes=1000), (60, 50), (60, 10), False),
        (SchedulerLimits(decode_bound=110, suspended_bytes=50), (60, 50), (60, 10), True),  # exactly fits both
    ],
    ids=["no-place-to-suspend", "held-over-suspended-room", "held-over-default-room", "peak-over-bound", "room"],
)
async def test_urgent_work_preempts_only_where_the_suspended_batch_has_room(
    stepper, limits, running_price, urgent_price, preempts
):
    scheduler = make_scheduler(stepper, limits)
    running = Stepped("running", BULK, 5, peak=running_price[0], held=running_price[1])
    urgent = Stepped("urgent", REALTIME, 2, peak=urgent_price[0], held=urgent_price[1])
    answers, _ = await second_arrives_while_first_runs(scheduler, stepper, running, urgent, preempts=preempts)
    assert answers == [running.answer, urgent.answer]
    waited_for_room = scheduler.stats.describe()[REALTIME]["waited_for_room"]
    if preempts:
        assert stepper.order() == preempted_order(running, urgent)
        assert waited_for_room == 0
    else:
        assert stepper.order() == one_after_another(running, urgent)
        assert waited_for_room > 0
    await finish(scheduler, stepper)


# ---- 4. the memory plan, under random traffic ---------------------------------------------------
# cheap requests fit beside each other (preemption is up to the class order and the places among
# the suspended), dear ones rarely do (up to the memory plan); held <= peak
priced = st.one_of(st.integers(1, 30), st.integers(31, 90)).flatmap(
    lambda peak: st.tuples(st.just(peak), st.integers(0, peak))
)
arrival = st.tuples(
    st.sampled_from(PRIORITIES),
    st.integers(2, 4),  # steps
    priced,  # a batch of one: its peak fits the bound of 100 on its own, not beside any state
    st.sampled_from([0, 0.001, 0.003, 0.006]),  # gap before it (s): most arrive while another runs
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=8),
    max_suspended=st.integers(0, 2),
    suspended_bytes=st.sampled_from([10, 25, 50, 100]),
)
def test_the_memory_plan_holds_at_every_step(arrivals, max_suspended, suspended_bytes):
    stepper = Stepper()
    limits = SchedulerLimits(
        max_batch_size=1, max_suspended=max_suspended, decode_bound=100, suspended_bytes=suspended_bytes
    )
    requests = [
        Stepped(f"r{i}", cls, steps, step_s=0.003, peak=peak, held=held)
        for i, (cls, steps, (peak, held), _) in enumerate(arrivals)
    ]

    async def scenario():
        scheduler = make_scheduler(stepper, limits)
        calls = []
        for request, (*_, gap) in zip(requests, arrivals, strict=True):
            if gap:
                await asyncio.sleep(gap)
            calls.append(asyncio.create_task(submit(scheduler, request)))
        answers = await asyncio.wait_for(asyncio.gather(*calls), HANG_S)
        assert await scheduler.drain(HANG_S)
        await scheduler.close()
        return answers

    try:
        answers = asyncio.run(scenario())
    finally:
        stepper.shutdown()
    assert stepper.violations == []
    assert stepper.most_inside == 1
    assert answers == [r.answer for r in requests]
    for r in requests:  # each step ran exactly once, in order
        assert stepper.steps_of(r.name) == list(range(r.steps))


# ---- 5. promotion: nothing waits forever ---------------------------------------------------------
@pytest.mark.parametrize(
    "priority, waited_s, promote_after_s, expected",
    [
        (BULK, 0.0, 1.0, BULK),
        (BULK, 0.99, 1.0, BULK),
        (BULK, 1.0, 1.0, INTERACTIVE),  # an exact multiple promotes
        (BULK, 1.5, 1.0, INTERACTIVE),
        (BULK, 2.0, 1.0, REALTIME),
        (BULK, 0.5, 0.25, REALTIME),
        (BULK, 1e6, 1.0, REALTIME),  # capped at the most urgent class
        (INTERACTIVE, 0.0, 1.0, INTERACTIVE),
        (INTERACTIVE, 0.25, 0.25, REALTIME),
        (INTERACTIVE, 7.0, 1.0, REALTIME),
        (REALTIME, 0.0, 1.0, REALTIME),
        (REALTIME, 100.0, 1.0, REALTIME),
    ],
)
def test_promoted(priority, waited_s, promote_after_s, expected):
    assert promoted(priority, waited_s, promote_after_s) == expected


async def test_bulk_under_a_steady_interactive_stream_is_promoted_and_finishes_while_the_stream_goes_on(stepper):
    batches = []
    scheduler = make_scheduler(stepper, SchedulerLimits(promote_after_s=0.2), on_batch=batches.append)
    stream_cap = 150  # without promotion the bulk request would wait for all of these (a failure, not a hang)
    calls, count = [], 0

    def next_interactive() -> Gate:
        """Held in its first step until its successor has arrived: the stream never pauses."""
        nonlocal count
        request = Stepped(f"interactive-{count}", INTERACTIVE, 2)
        count += 1
        calls.append(asyncio.create_task(submit(scheduler, request)))
        return stepper.hold(request.name, 0)

    gate = next_interactive()
    await until(gate.reached.is_set, "the first interactive request's step")
    bulk = Stepped("bulk", BULK, 3)
    bulk_call = asyncio.create_task(submit(scheduler, bulk))
    bulk_done_at = None
    while count < stream_cap and (bulk_done_at is None or count < bulk_done_at + 2):
        successor = next_interactive()
        await until(lambda: scheduler.queued_items(INTERACTIVE) == 1, "the successor queued")
        gate.open()
        await until(successor.reached.is_set, "the successor's first step")
        gate = successor
        if bulk_done_at is None and bulk_call.done():
            bulk_done_at = count
    gate.open()
    assert await asyncio.wait_for(bulk_call, HANG_S) == bulk.answer
    assert await asyncio.wait_for(asyncio.gather(*calls), HANG_S) == [
        ("done", f"interactive-{i}", (0, 1)) for i in range(count)
    ]

    order = [name for name, _ in stepper.order()]
    first_bulk, last_bulk = order.index("bulk"), len(order) - 1 - order[::-1].index("bulk")
    assert bulk_done_at is not None and count < stream_cap
    assert any(name.startswith("interactive") for name in order[:first_bulk])
    assert any(name.startswith("interactive") for name in order[last_bulk + 1 :])  # the stream went on
    (bulk_stats,) = [b for b in batches if b.priority == BULK]
    assert bulk_stats.promotions >= 1
    assert scheduler.stats.describe()[BULK]["promotions"] == bulk_stats.promotions
    await finish(scheduler, stepper)


# ---- 6. per-class queue bounds ------------------------------------------------------------------
async def test_a_full_bulk_queue_refuses_bulk_but_still_accepts_the_other_classes(stepper):
    scheduler = make_scheduler(stepper, SchedulerLimits(queued_items={BULK: 2}))
    running = Stepped("bulk-0", BULK, 3)
    gate = stepper.hold(running.name, 1)
    calls = [asyncio.create_task(submit(scheduler, running))]
    await until(gate.reached.is_set, "the running bulk batch's step 1")
    queued = [Stepped(f"bulk-{i}", BULK, 1) for i in (1, 2)]
    calls += [asyncio.create_task(submit(scheduler, r)) for r in queued]
    await until(lambda: scheduler.queued_items(BULK) == 2, "a full bulk queue")

    refusals = []
    for i in range(3, 13):  # the flood
        with pytest.raises(QueueFull) as refused:
            await submit(scheduler, Stepped(f"bulk-{i}", BULK, 1))
        refusals.append(refused.value)
    others = [Stepped("realtime", REALTIME, 2), Stepped("interactive", INTERACTIVE, 2)]
    calls += [asyncio.create_task(submit(scheduler, r)) for r in others]
    await asyncio.sleep(0)  # both were accepted: a refusal raises before the caller's first await
    gate.open()
    answers = await asyncio.wait_for(asyncio.gather(*calls), HANG_S)

    assert [r.priority for r in refusals] == [BULK] * 10
    assert all(r.retry_after_s > 0 for r in refusals)
    assert answers == [r.answer for r in (running, *queued, *others)]
    described = scheduler.stats.describe()
    assert (described[BULK]["refused"], described[REALTIME]["refused"], described[INTERACTIVE]["refused"]) == (10, 0, 0)
    await finish(scheduler, stepper)


# ---- 7. callers that leave, deadlines that pass ------------------------------------------------
async def test_a_suspended_batch_whose_caller_left_stops_at_its_check_and_never_runs_again(stepper):
    scheduler = make_scheduler(stepper)
    bulk, urgent = Stepped("bulk", BULK, 6), Stepped("urgent", REALTIME, 3)
    bulk_gate, urgent_gate = stepper.hold(bulk.name, 2), stepper.hold(urgent.name, 1)
    bulk_call = asyncio.create_task(submit(scheduler, bulk))
    await until(bulk_gate.reached.is_set, "the bulk batch's step 2")
    urgent_call = asyncio.create_task(submit(scheduler, urgent))
    await until(lambda: scheduler.turns.waiting == 1, "the urgent batch waiting for the device")
    bulk_gate.open()
    await until(urgent_gate.reached.is_set, "the urgent batch's step 1")  # the bulk batch is suspended now

    bulk_call.cancel()
    # the urgent batch still holds the device: the bulk batch can only stop where it is suspended
    await until(lambda: stepper.stopped == [bulk.name], "the suspended batch's check to stop it")
    urgent_gate.open()
    assert await asyncio.wait_for(urgent_call, HANG_S) == urgent.answer
    with pytest.raises(asyncio.CancelledError):
        await bulk_call
    await until(lambda: scheduler.running == 0, "no started batch left")
    assert stepper.steps_of(bulk.name) == [0, 1, 2]
    assert stepper.order() == preempted_order(bulk, urgent)[:6]  # nothing of the bulk batch after the urgent one
    await finish(scheduler, stepper)


async def test_a_deadline_that_passes_while_queued_is_deadline_exceeded_and_never_decoded(stepper):
    scheduler = make_scheduler(stepper)
    # more urgent than the late request (an earlier deadline would start it beside the running one)
    running = Stepped("running", REALTIME, 2)
    gate = stepper.hold(running.name, 0)
    running_call = asyncio.create_task(submit(scheduler, running))
    await until(gate.reached.is_set, "the running batch's first step")
    with pytest.raises(DeadlineExceeded):
        await submit(scheduler, Stepped("late", BULK, 1, timeout_s=0.05))
    gate.open()
    assert await asyncio.wait_for(running_call, HANG_S) == running.answer
    await finish(scheduler, stepper)
    assert stepper.steps_of("late") == []


# ---- 8. statistics ------------------------------------------------------------------------------
async def test_stats_of_a_preempted_batch_and_the_classes_waits(stepper):
    batches = []
    scheduler = make_scheduler(stepper, on_batch=batches.append)
    waits = ("queue_wait_ms_p50", "queue_wait_ms_p99")
    assert all(scheduler.stats.describe()[cls][w] is None for cls in PRIORITIES for w in waits)

    running, urgent = Stepped("running", BULK, 6), Stepped("urgent", REALTIME, 3)
    await second_arrives_while_first_runs(scheduler, stepper, running, urgent)
    await finish(scheduler, stepper)

    stats = {b.requests[0].name: b for b in batches}
    assert stats["running"].preempted_s > 0
    assert (stats["running"].preemptions, stats["running"].steps, stats["running"].priority) == (1, 6, BULK)
    # waiting for its first turn is not being suspended
    assert (stats["urgent"].preempted_s, stats["urgent"].preemptions, stats["urgent"].steps) == (0.0, 0, 3)
    described = scheduler.stats.describe()
    for cls in (BULK, REALTIME):
        assert isinstance(described[cls]["queue_wait_ms_p50"], float)
        assert 0 <= described[cls]["queue_wait_ms_p50"] <= described[cls]["queue_wait_ms_p99"]
    assert all(described[INTERACTIVE][w] is None for w in waits)  # no interactive traffic
    assert (described[BULK]["batches"], described[BULK]["steps"], described[BULK]["preemptions"]) == (1, 6, 1)
    assert described[BULK]["preempted_ms"] > 0
    assert (described[REALTIME]["steps"], described[REALTIME]["preemptions"]) == (3, 0)


# ---- 9. the class a caller may claim ------------------------------------------------------------
def test_unclaimed_classes_by_default():
    assert request_class(None, Scheduling()) == INTERACTIVE
    assert session_class(None, Scheduling()) == REALTIME


def test_unclaimed_is_never_above_the_highest_class():
    assert request_class(None, Scheduling(requests_highest_class=BULK)) == BULK
    assert session_class(None, Scheduling(sessions_highest_class=INTERACTIVE)) == INTERACTIVE
    assert request_class(None, Scheduling(requests_highest_class=REALTIME)) == INTERACTIVE  # a ceiling, not a default


@pytest.mark.parametrize(
    "classify, scheduling, claim",
    [
        (request_class, Scheduling(), REALTIME),
        (request_class, Scheduling(requests_highest_class=BULK), INTERACTIVE),
        (session_class, Scheduling(sessions_highest_class=INTERACTIVE), REALTIME),
        (session_class, Scheduling(sessions_highest_class=BULK), INTERACTIVE),
    ],
)
def test_a_claim_above_the_highest_class_is_refused_naming_priority(classify, scheduling, claim):
    with pytest.raises(InvalidInput) as refused:
        classify(claim, scheduling)
    assert refused.value.field == "priority"


@pytest.mark.parametrize("highest", PRIORITIES)
def test_a_less_urgent_claim_is_always_allowed(highest):
    scheduling = Scheduling(requests_highest_class=highest, sessions_highest_class=highest)
    for claim in PRIORITIES[RANK[highest] :]:
        assert request_class(claim, scheduling) == claim
        assert session_class(claim, scheduling) == claim


# ---- defects a review found (each failed before its fix) ------------------------------------------
async def test_a_promoted_batch_resuming_never_leaves_more_suspended_than_the_room(stepper):
    limits = SchedulerLimits(decode_bound=1000, suspended_bytes=80, promote_after_s=0.1)
    scheduler = make_scheduler(stepper, limits)
    bulk = Stepped("bulk", BULK, 4, peak=60, held=60)  # 60 suspended: fits the room of 80
    urgent = Stepped("urgent", INTERACTIVE, 4, peak=90, held=90)  # 90 suspended would not
    bulk_gate, urgent_gate = stepper.hold(bulk.name, 2), stepper.hold(urgent.name, 1)
    calls = [asyncio.create_task(submit(scheduler, bulk))]
    await until(bulk_gate.reached.is_set, "the bulk batch's step 2")
    calls.append(asyncio.create_task(submit(scheduler, urgent)))
    await until(lambda: scheduler.turns.waiting == 1, "the urgent batch waiting for the device")
    bulk_gate.open()
    await until(urgent_gate.reached.is_set, "the urgent batch's step 1")
    bulk_job = next(job for job in scheduler._started if job.key == bulk.name)
    # suspended long enough to be promoted past the (older-arrived) interactive batch's class
    await until(
        lambda: promoted(BULK, bulk_job.waited_s(scheduler.clock()), limits.promote_after_s) != BULK,
        "the suspended bulk batch's promotion",
    )
    urgent_gate.open()
    answers = await asyncio.wait_for(asyncio.gather(*calls), HANG_S)
    assert answers == [bulk.answer, urgent.answer]
    assert stepper.violations == []


async def test_an_equally_urgent_request_on_the_same_clock_tick_takes_no_place_among_the_suspended(stepper):
    scheduler = make_scheduler(stepper, SchedulerLimits(max_suspended=1), clock=lambda: 100.0)
    earlier = Stepped("earlier", INTERACTIVE, 1)
    assert await asyncio.wait_for(submit(scheduler, earlier), HANG_S) == earlier.answer  # took start order 0
    running, same = Stepped("running", INTERACTIVE, 4), Stepped("same", INTERACTIVE, 1)
    urgent = Stepped("rt", REALTIME, 1)
    gate = stepper.hold(running.name, 1)
    calls = [asyncio.create_task(submit(scheduler, running))]
    await until(gate.reached.is_set, "the running batch's step 1")
    calls.append(asyncio.create_task(submit(scheduler, same)))
    await asyncio.sleep(SETTLE_S)
    calls.append(asyncio.create_task(submit(scheduler, urgent)))  # the one place to suspend should be for it
    await asyncio.sleep(SETTLE_S)
    gate.open()
    answers = await asyncio.wait_for(asyncio.gather(*calls), HANG_S)
    await scheduler.close()  # (no drain: it times out on the scheduler's frozen clock)
    assert answers == [running.answer, same.answer, urgent.answer]
    assert stepper.order()[1:] == [*preempted_order(running, urgent, held_at=1), ("same", 0)]


async def test_a_started_batch_whose_callers_left_before_its_first_turn_never_runs(stepper, monkeypatch):
    # the race made certain: the turn is granted long before a wait slice would end
    monkeypatch.setattr(device_turns, "WAIT_SLICE_S", HANG_S / 2)
    scheduler = make_scheduler(stepper)
    running = Stepped("running", BULK, 3)
    gone = Stepped("gone", BULK, 2, timeout_s=30)  # an earlier deadline: started beside the running batch
    gate = stepper.hold(running.name, 0)
    running_call = asyncio.create_task(submit(scheduler, running))
    await until(gate.reached.is_set, "the running batch's first step")
    gone_call = asyncio.create_task(submit(scheduler, gone))
    await until(lambda: scheduler.turns.waiting == 1, "the second batch waiting for its first turn")
    gone_job = next(job for job in scheduler._started if job.key == gone.name)
    gone_call.cancel()
    await until(gone_job.turn._abandoned.is_set, "the batch's callers all gone")
    gate.open()
    assert await asyncio.wait_for(running_call, HANG_S) == running.answer
    with pytest.raises(asyncio.CancelledError):
        await gone_call
    await finish(scheduler, stepper)
    assert stepper.steps_of(gone.name) == []


@pytest.mark.parametrize("timeout_s", [None, 30.0])
async def test_a_runner_failing_with_a_timeout_error_fails_its_caller_with_that_error(timeout_s):
    def times_out(batch, abandoned, turn):
        raise TimeoutError("a peer replica did not answer")

    scheduler = StepScheduler(times_out, SchedulerLimits())
    with pytest.raises(TimeoutError, match="peer replica"):
        await asyncio.wait_for(scheduler.submit(Stepped("request"), timeout_s, BULK), HANG_S)
    await scheduler.close()


def test_a_decode_stopped_while_suspended_holds_the_device_again_before_it_unwinds():
    """A batch of several requests goes on to its next request's run after one request's caller
    left while it was suspended: it must do so holding the device, never beside its holder."""
    turns = device_turns.DeviceTurns(lambda urgency: urgency, time.monotonic)
    bulk, realtime = turns.turn((2,)), turns.turn((0,))
    bulk.take()
    urgent_holds, urgent_done = threading.Event(), threading.Event()

    def urgent() -> None:
        realtime.take()
        urgent_holds.set()
        assert urgent_done.wait(HANG_S)
        realtime.release()

    class CallerLeft(Exception):
        pass

    def caller_left() -> None:
        raise CallerLeft

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(urgent)
        while not turns.waiting:
            time.sleep(0.001)
        stopped = pool.submit(bulk.between_steps, caller_left)  # suspended, then told its caller left
        assert urgent_holds.wait(HANG_S)
        time.sleep(0.2)  # several wait slices: the stop is seen while the urgent decode holds the device
        assert not stopped.done() and turns.holder is realtime
        urgent_done.set()
        running.result(HANG_S)
        with pytest.raises(CallerLeft):
            stopped.result(HANG_S)
    assert turns.holder is bulk  # it unwinds, or runs its next request, on the device
    bulk.release()
    assert turns.holder is None
