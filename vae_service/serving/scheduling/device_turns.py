"""Whose step the device runs next: a started batch holds its `Turn` while it runs a step and, at
each step boundary (the engine's `between_steps`), gives the device to a more urgent started batch
if one waits, then waits for its own next turn, suspended there with its state on its own thread.
One turn runs at a time, so a suspended decode's tensors are never touched while another runs:
every decode runs the same operations in the same order as alone (bit-identical answers)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from vae_service.engine.request.context import WAIT_SLICE_S


@dataclass(frozen=True)
class StepPrice:
    """A started batch's memory plan: the peak of its running step, and what it holds between two
    steps (counted while it is suspended)."""

    peak: int
    held: int


class Abandoned(Exception):
    """Every caller of a batch left before its first turn: nothing of it ran."""


class Turn:
    def __init__(self, turns: DeviceTurns, job):
        self.turns, self.job = turns, job
        self.steps = self.preemptions = 0
        self.suspended_s = 0.0  # waiting for the device after its first step
        self.first_wait_s = 0.0  # waiting for its first step
        self.waiting_since: float | None = None
        self.ran = False  # it ran a step: waiting after that is being suspended
        self.step_began: float | None = None  # the running step's start, while it holds the device
        self.longest_step_s = 0.0
        self.held_s = 0.0  # its steps' time on the device: what its work cost
        self._abandoned: threading.Event | None = None

    def watch(self, abandoned: threading.Event) -> None:
        """Its callers' signal: a batch all of whose callers left stops waiting for its first turn."""
        self._abandoned = abandoned

    def take(self) -> None:
        self.turns.take(self, self._check_first)

    def between_steps(self, check: Callable[[], None]) -> None:
        """A step boundary: run on, or give the device to more urgent work and wait (`check` runs
        every WAIT_SLICE_S meanwhile: a decode nobody waits for stops while suspended)."""
        self.steps += 1
        self._step_ended()
        try:
            self.turns.between_steps(self, check)
        except BaseException:
            # stopped while suspended: the decode unwinds (or goes on to its next request's run)
            # holding the device again, never beside the holder
            self.turns.take(self, lambda: None)
            raise
        finally:
            self.step_began = self.turns.clock()

    def aside(self, wait: Callable[[], None]) -> None:
        """The device to other work while `wait()` runs off it, then a turn again (by urgency, as
        any waiting decode; the wait itself is not time suspended). A wait that raises still ends
        holding the device: the decode unwinds as it would have."""
        self.release()
        try:
            wait()
        finally:
            self.turns.take(self, lambda: None)

    def release(self) -> None:
        self._step_ended()
        self.turns.release(self)

    def _step_ended(self) -> None:
        if self.step_began is not None:
            step_s = self.turns.clock() - self.step_began
            self.step_began = None  # before the sum: a reader meanwhile misses the step, never counts it twice
            self.longest_step_s = max(self.longest_step_s, step_s)
            self.held_s += step_s
            self.turns.busy_s += step_s  # only the holder runs a step: one writer at a time

    def waited_s(self, now: float) -> float:
        """Time spent waiting for the device since it started, the current wait included."""
        current = 0.0 if self.waiting_since is None else now - self.waiting_since
        return self.first_wait_s + self.suspended_s + current

    def _check_first(self) -> None:
        if self._abandoned is not None and self._abandoned.is_set():
            raise Abandoned("every caller of the batch left before it reached the device")


class DeviceTurns:
    def __init__(
        self,
        urgency: Callable[[object], tuple],
        clock: Callable[[], float],
        may_suspend: Callable[[object, object], bool] = lambda holder, successor: True,
    ):
        """`urgency(job)`: smaller runs first. `may_suspend(holder, successor)`: whether the holder's
        job may be suspended for the successor's (what would then be suspended fits its room)."""
        self.urgency, self.clock, self.may_suspend = urgency, clock, may_suspend
        self.holder: Turn | None = None
        self._waiting: list[Turn] = []
        self._cond = threading.Condition()
        self.busy_s = 0.0  # the device's time running steps, ended ones (busy_seconds: with the running one)
        self.since = clock()

    def busy_seconds(self) -> float:
        """Seconds the device has run steps since `since`, the running step so far included (read
        from any thread: a step ending meanwhile may be missed by this reading, never by the next)."""
        done = self.busy_s  # first: a step ending after this read is counted as running, never twice
        holder = self.holder
        began = None if holder is None else holder.step_began
        running = 0.0 if began is None else max(0.0, self.clock() - began)
        return done + running

    def turn(self, job) -> Turn:
        return Turn(self, job)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def take(self, turn: Turn, check: Callable[[], None]) -> None:
        with self._cond:
            turn.waiting_since = self.clock()
            self._waiting.append(turn)
            self._grant()
            try:
                while self.holder is not turn:
                    self._cond.wait(WAIT_SLICE_S)
                    if self.holder is not turn:
                        check()
                check()  # granted: but a decode nobody waits for any more runs no step
            except BaseException:
                if turn in self._waiting:
                    self._waiting.remove(turn)
                elif self.holder is turn:
                    self.holder = None
                    self._grant()
                self._stop_waiting(turn)
                raise
            self._stop_waiting(turn)
            turn.ran = True
            turn.step_began = self.clock()

    def between_steps(self, turn: Turn, check: Callable[[], None]) -> None:
        with self._cond:
            if self.holder is turn:  # (a turn not holding the device waits for it below)
                if not self._waiting:
                    return
                successor = self._next()
                if self.urgency(successor.job) >= self.urgency(turn.job):
                    return
                if not self.may_suspend(turn.job, successor.job):  # no room for its state: it runs on
                    return
                turn.preemptions += 1
                self.holder = None
                self._grant()
        self.take(turn, check)

    def release(self, turn: Turn) -> None:
        with self._cond:
            if self.holder is turn:
                self.holder = None
                self._grant()
            elif turn in self._waiting:
                self._waiting.remove(turn)

    def _next(self) -> Turn:
        return min(self._waiting, key=lambda t: self.urgency(t.job))

    def _grant(self) -> None:
        if self.holder is None and self._waiting:
            best = self._next()
            self._waiting.remove(best)
            self.holder = best
            self._cond.notify_all()

    def _stop_waiting(self, turn: Turn) -> None:
        if turn.waiting_since is not None:
            waited = self.clock() - turn.waiting_since
            if turn.ran:
                turn.suspended_s += waited
            else:
                turn.first_wait_s += waited
        turn.waiting_since = None
