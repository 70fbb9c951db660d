"""A decode suspended at its step boundaries while more urgent decodes of the same engine run (the
conformance suites' preempted column): the scheduler's own turns (serving/scheduling/device_turns.py)
with an interloper waiting at each of the first `interlopers` boundaries. Each runs to its end on a
device thread of its own, `high` and `lossless` in turn (another gate, another decode's walk)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.serving.scheduling.device_turns import DeviceTurns

INTERLOPER_TIMEOUT_S = 120.0


class Interloping:
    def __init__(self, engine: DecodeEngine, interlopers: int = 3):
        self.engine, self.interlopers, self.answers = engine, interlopers, []
        # made here, before any decode: what the decode under test measures is its own
        self.requests = [self.request(k) for k in range(interlopers)]
        self.turns = DeviceTurns(lambda urgency: urgency, time.monotonic)
        self.turn = self.turns.turn((1,))  # the decode under test: less urgent than every interloper
        self.device = ThreadPoolExecutor(1, thread_name_prefix="interloper", initializer=engine.bind_thread)

    def __enter__(self) -> Interloping:
        return self

    def __exit__(self, *exc) -> None:
        self.device.shutdown(wait=True)

    def between_steps(self, check) -> None:
        if len(self.answers) >= self.interlopers:
            return self.turn.between_steps(check)
        request = self.requests[len(self.answers)]
        done = self.device.submit(self._interlope, request)
        while not self.turns.waiting and not done.done():  # until the interloper waits for the device
            time.sleep(0.001)
        self.turn.between_steps(check)  # suspended here until the interloper gave the device back
        self.answers.append((request, done.result(INTERLOPER_TIMEOUT_S)))

    def aside(self, wait) -> None:
        self.turn.aside(wait)

    def request(self, k: int) -> DecodeRequest:
        channels = self.engine.spec.latent_channels
        shape = (1, channels, 2, 4, 4) if self.engine.runtime.chunked else (1, channels, 5, 5)
        z = torch.randn(*shape, generator=torch.Generator().manual_seed(100 + k))
        return DecodeRequest(z, quality=("high", "lossless")[k % 2], output="float", latents_scaled=True)

    def _interlope(self, request: DecodeRequest):
        urgent = self.turns.turn((0,))
        urgent.take()
        try:
            (answer,) = self.engine.decode([self.engine.prepare(request)], steps=urgent)
        finally:
            urgent.release()
        return answer

    def check_interlopers(self, device) -> None:
        """Each interloper answered the bits of its own decode alone (on `device`)."""
        assert self.answers, "the decode met no step boundary"
        assert self.turn.preemptions == len(self.answers)
        for request, answer in self.answers:
            (alone,) = device.submit(self.engine.decode, [self.engine.prepare(request)]).result()
            assert torch.equal(answer.output, alone.output), "an interloper's answer differs from its decode alone"
