"""What a replica reports to the autoscaling policy (serving/scheduling/load_report.py), from a real
StepScheduler on a clock the test moves: the device's busy fraction per report period (the running
step included), the latency classes' waits (those started, and those still queued), bulk backlog
in device seconds, session room from open sessions' bytes (never from connections), all floats."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from vae_service.serving.scheduling.classes import BULK, INTERACTIVE, REALTIME
from vae_service.serving.scheduling.device_turns import DeviceTurns
from vae_service.serving.scheduling.load_report import load_report
from vae_service.serving.scheduling.scheduler import SchedulerLimits, StepScheduler
from vae_service.serving.scheduling.wait_stats import ClassStats

pytestmark = pytest.mark.timeout(60)
HANG_S = 10.0


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Work:
    """`cost_s` of device time per item (the runner moves the clock by it); `gate`: held inside
    its step until opened (the device with it)."""

    name: str
    cost_s: float = 0.5
    items: int = 1
    gate: threading.Event | None = field(default=None, compare=False)

    @property
    def batch_key(self):
        return self.name


class Replica:
    """A StepScheduler (preemption off: one batch at a time, the rest queued) and the sessions'
    figures, as load_report reads them off a DecodeService."""

    def __init__(
        self,
        clock: Clock,
        held_bytes: int = 0,
        budget: int = 1000,
        sessions: int = 0,
        connections: int = 0,
        max_sessions: int = 16,
        session_connections: int = 16,
    ):
        self.clock, self.entered = clock, threading.Event()
        self.executor = ThreadPoolExecutor(4)
        self.scheduler = StepScheduler(
            self._run, SchedulerLimits(preemption=False), clock=clock, executor=self.executor
        )
        self.sessions = SimpleNamespace(
            open_sessions=dict.fromkeys(range(sessions)),
            held_bytes=held_bytes,
            budget=lambda: budget,
            connections=connections,
        )
        self.config = SimpleNamespace(
            limits=SimpleNamespace(max_sessions=max_sessions), session_connections=session_connections
        )

    def _run(self, requests: list[Work], abandoned, turn) -> list:
        self.entered.set()
        for work in requests:
            self.clock.t += work.cost_s * work.items
            if work.gate is not None and not work.gate.wait(HANG_S):
                raise TimeoutError("never opened")
        return [work.name for work in requests]

    def report(self) -> dict[str, float]:
        return load_report(self)


async def until(condition) -> None:
    for _ in range(int(HANG_S / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not reached")


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), HANG_S * 2))


def test_an_idle_replica_reports_nothing_to_do_all_in_floats():
    replica = Replica(Clock(), connections=3)
    report = replica.report()
    assert all(type(v) is float for v in report.values()), report  # Serve drops custom metrics otherwise
    assert report["device_busy"] == report["session_room"] == report["bulk_backlog_s"] == 0.0
    assert report["realtime_wait_ms"] == report["interactive_wait_ms"] == 0.0
    assert report["connections"] == 3.0 and report["sessions_open"] == 0.0


def test_device_busy_is_the_fraction_of_each_report_period_the_device_ran_steps():
    clock = Clock()
    replica = Replica(clock)
    replica.report()  # the first period starts here

    async def scenario():
        await replica.scheduler.submit(Work("a", cost_s=3.0))
        clock.t += 7.0
        assert replica.report()["device_busy"] == pytest.approx(0.3)  # 3 s of 10
        clock.t += 5.0
        assert replica.report()["device_busy"] == 0.0  # the next period: nothing ran

    run(scenario)


def test_a_step_still_running_counts_as_busy_so_far():
    clock = Clock()
    replica = Replica(clock)
    replica.report()
    gate = threading.Event()

    async def scenario():
        running = asyncio.create_task(replica.scheduler.submit(Work("long", cost_s=0.0, gate=gate)))
        await until(replica.entered.is_set)
        clock.t += 4.0  # 4 s into its step
        assert replica.report()["device_busy"] == pytest.approx(1.0)
        clock.t += 4.0
        gate.set()
        await running
        clock.t += 4.0  # the step ended at 8 s: the period since the last report is half busy
        assert replica.report()["device_busy"] == pytest.approx(0.5)

    run(scenario)


def test_a_latency_class_kept_waiting_shows_its_wait_before_it_starts_and_after():
    clock = Clock()
    replica = Replica(clock)
    gate = threading.Event()

    async def scenario():
        blocker = asyncio.create_task(replica.scheduler.submit(Work("bulk", gate=gate), priority=BULK))
        await until(replica.entered.is_set)
        chunk = asyncio.create_task(replica.scheduler.submit(Work("chunk", cost_s=0.01), priority=REALTIME))
        await until(lambda: replica.scheduler.queued_items(REALTIME))
        clock.t += 0.3
        report = replica.report()
        # queued 300 ms behind a batch that holds the device: seen while it still waits
        assert report["realtime_wait_ms"] == pytest.approx(300.0)
        assert report["interactive_wait_ms"] == 0.0 and report["realtime_queued"] == 1.0
        gate.set()
        await asyncio.gather(blocker, chunk)
        # ... and once started: its wait is the period's p90
        assert replica.report()["realtime_wait_ms"] == pytest.approx(300.0)
        assert replica.report()["realtime_wait_ms"] == 0.0  # a period without waits

    run(scenario)


def test_bulk_backlog_is_queued_bulk_items_in_recent_device_seconds_per_item():
    clock = Clock()
    replica = Replica(clock)
    gate = threading.Event()

    async def scenario():
        scheduler = replica.scheduler
        await scheduler.submit(Work("warm", cost_s=0.25, items=1), priority=INTERACTIVE)
        blocker = asyncio.create_task(scheduler.submit(Work("block", cost_s=0.0, gate=gate), priority=INTERACTIVE))
        await until(replica.entered.is_set)
        queued = [asyncio.create_task(scheduler.submit(Work(f"b{i}"), priority=BULK)) for i in range(8)]
        await until(lambda: scheduler.queued_items(BULK) == 8)
        # no bulk item has run yet: priced by what an item of another class took (the same decoder)
        assert replica.report()["bulk_backlog_s"] == pytest.approx(8 * 0.25)  # "warm": 0.25 s for its item
        gate.set()
        await asyncio.gather(blocker, *queued)
        assert replica.report()["bulk_backlog_s"] == 0.0  # nothing queued: nothing owed
        gate2 = threading.Event()
        replica.entered.clear()
        blocker = asyncio.create_task(scheduler.submit(Work("block2", cost_s=0.0, gate=gate2), priority=BULK))
        await until(replica.entered.is_set)
        queued = [asyncio.create_task(scheduler.submit(Work(f"c{i}", items=2), priority=BULK)) for i in range(5)]
        await until(lambda: scheduler.queued_items(BULK) == 10)
        assert scheduler.stats.seconds_per_item(BULK) == pytest.approx(0.5)  # b0..b7, 0.5 s each
        assert replica.report()["bulk_backlog_s"] == pytest.approx(10 * 0.5)
        gate2.set()
        await asyncio.gather(blocker, *queued)

    run(scenario)


@pytest.mark.parametrize(
    ("held", "budget", "sessions", "connections", "room"),
    [
        (0, 1000, 0, 12, 0.0),  # connections without a session hold nothing
        (250, 1000, 5, 5, 0.25),  # idle sessions hold their priced bytes all the same
        (900, 1000, 9, 16, 0.9),
        (10, 0, 1, 1, 1.0),  # no session budget: any session fills it
    ],
)
def test_session_room_is_open_sessions_bytes_over_the_budget(held, budget, sessions, connections, room):
    replica = Replica(Clock(), held_bytes=held, budget=budget, sessions=sessions, connections=connections)
    report = replica.report()
    assert report["session_room"] == pytest.approx(room)
    assert (report["sessions_open"], report["connections"]) == (sessions, connections)


def test_the_device_turns_count_steps_held_not_time_suspended_or_aside():
    clock = Clock(0.0)
    turns = DeviceTurns(lambda job: 0, clock)
    turn = turns.turn("job")
    turn.take()
    clock.t += 2.0
    turn.between_steps(lambda: None)  # no one waits: it runs on
    clock.t += 1.0
    assert turns.busy_seconds() == pytest.approx(3.0)  # the running step so far included
    turn.aside(lambda: setattr(clock, "t", clock.t + 5.0))  # a lagging reader, off the device
    clock.t += 0.5
    turn.release()
    assert turns.busy_seconds() == pytest.approx(3.5) and turn.held_s == pytest.approx(3.5)
    clock.t += 10.0
    assert turns.busy_seconds() == pytest.approx(3.5)


def test_class_stats_keep_timed_waits_and_the_cost_of_an_item():
    clock = Clock(0.0)
    stats = ClassStats(clock)
    stats.started(REALTIME, [0.1, 0.2])
    clock.t = 5.0
    stats.started(REALTIME, [0.3])
    assert stats.waits_since(REALTIME, 1.0) == [0.3]
    assert stats.waits_since(REALTIME, -1.0) == [0.1, 0.2, 0.3]
    assert stats.describe()[REALTIME]["queue_wait_ms_p50"] == 200.0  # /health reads the same waits
    assert stats.seconds_per_item(BULK) is None
    for held_s, items in ((1.0, 4), (3.0, 4)):
        stats.finished(
            BULK,
            SimpleNamespace(ran=True, held_s=held_s, steps=1, preemptions=0, suspended_s=0.0, longest_step_s=0.1),
            0,
            items,
        )
    stats.finished(
        BULK, SimpleNamespace(ran=False, held_s=0.0, steps=0, preemptions=0, suspended_s=0.0, longest_step_s=0.0), 0, 8
    )
    assert stats.seconds_per_item(BULK) == pytest.approx(0.5)  # a batch that never ran costs nothing


@pytest.mark.parametrize(
    ("sessions", "connections", "max_sessions", "max_connections", "expected"),
    [
        (0, 0, 16, 16, 0.0),
        (4, 8, 16, 16, 0.5),  # the connections are the tighter cap
        (6, 2, 8, 16, 0.75),  # the sessions are
        (0, 3, 16, 0, 1.0),  # a cap of 0 with anything on it: full
    ],
)
def test_session_slots_are_the_tighter_session_cap_in_use(
    sessions, connections, max_sessions, max_connections, expected
):
    replica = Replica(Clock(), sessions=sessions, connections=connections, max_sessions=max_sessions,
                      session_connections=max_connections)  # fmt: skip
    assert replica.report()["session_slots"] == expected
