"""Decode calls on several threads: the engine keeps no per-call state (engine/plan.py), so two
calls interleaved step by step, on one engine or on two, each get their own answer, and one
call's abandonment stops that call only."""

import threading

import pytest
import torch

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.request.errors import DecodeAbandoned
from vae_service.engine.request.result import DecodeResult

STEP_TIMEOUT_S = 60


class Turns:
    """Two threads' decodes take turns at every checkpoint (before each item, tile or latent
    frame): both calls have started before either takes a step; then each waits for its turn,
    hands it to the other and runs its step, so the calls overlap for their whole length. A
    thread whose call finished is not waited for."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.started: set[int] = set()
        self.finished: set[int] = set()

    def take(self, me: int) -> None:
        with self.cond:
            self.started.add(me)
            self.cond.notify_all()
            other = 1 - me

            def my_turn() -> bool:
                return other in self.finished or (other in self.started and self.turn == me)

            ok = self.cond.wait_for(my_turn, STEP_TIMEOUT_S)
            assert ok, "the other call never reached its next step"
            self.turn = 1 - me
            self.cond.notify_all()

    def finish(self, me: int) -> None:
        with self.cond:
            self.finished.add(me)
            self.cond.notify_all()


class Stepper(threading.Event):
    """The `abandoned` event a call gets: each check is a step of `Turns`; set after
    `abandon_after` steps when given (the call's requests went away)."""

    def __init__(self, turns: Turns, me: int, abandon_after: int | None = None):
        super().__init__()
        self.turns, self.me, self.abandon_after, self.steps = turns, me, abandon_after, 0

    def is_set(self) -> bool:
        self.turns.take(self.me)
        self.steps += 1
        return self.abandon_after is not None and self.steps > self.abandon_after


def engine_for(folder, name) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model=str(folder), model_name=name, device="cpu", cpu_threads=1))


@pytest.fixture(scope="module")
def engines(kl_dir, wan_dir):
    return {"kl": engine_for(kl_dir, "kl"), "wan": engine_for(wan_dir, "wan")}


def request(kind: str, quality: str, seed: int) -> DecodeRequest:
    g = torch.Generator().manual_seed(seed)
    shape = (3, 4, 7, 5) if kind == "kl" else (2, 4, 4, 3, 5)  # 3 images; 2 clips of 4 latent frames
    return DecodeRequest(torch.randn(*shape, generator=g), quality=quality, output="float")


def decode_alone(engine: DecodeEngine, req: DecodeRequest) -> torch.Tensor:
    engine.bind_thread()
    (result,) = engine.decode([engine.prepare(req)])
    return result.output


def interleaved(calls):
    """Run `calls` [(engine, request, abandon_after)] on two threads taking turns; each call's
    DecodeResult or the exception it raised."""
    turns, answers = Turns(), [None, None]

    def work(me: int) -> None:
        engine, req, abandon_after = calls[me]
        engine.bind_thread()
        try:
            (answers[me],) = engine.decode([engine.prepare(req)], Stepper(turns, me, abandon_after))
        except Exception as exc:  # the answer under test
            answers[me] = exc
        finally:
            turns.finish(me)

    threads = [threading.Thread(target=work, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * STEP_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    return answers


@pytest.mark.parametrize(
    "first, second",
    [
        (("kl", "lossless"), ("kl", "high")),  # one engine: the fast-path gate of one call only
        (("wan", "lossless"), ("wan", "high")),  # one engine: each call's walk and its history
        (("kl", "high"), ("wan", "lossless")),  # two engines
        (("wan", "high"), ("kl", "lossless")),
    ],
)
def test_two_calls_interleaved_on_two_threads_each_get_their_answer(engines, first, second):
    pairs = [(engines[kind], request(kind, quality, seed)) for seed, (kind, quality) in enumerate((first, second))]
    expected = [decode_alone(engine, req) for engine, req in pairs]
    answers = interleaved([(engine, req, None) for engine, req in pairs])
    for answer, want, (kind, quality) in zip(answers, expected, (first, second), strict=True):
        assert isinstance(answer, DecodeResult), answer
        assert answer.quality == quality and torch.equal(answer.output, want), (kind, quality)


@pytest.mark.parametrize("kind", ["kl", "wan"])
def test_an_abandoned_call_stops_and_the_other_call_on_the_engine_finishes(engines, kind):
    engine = engines[kind]
    requests = [request(kind, "lossless", 7), request(kind, "lossless", 8)]
    expected = decode_alone(engine, requests[1])
    answers = interleaved([(engine, requests[0], 1), (engine, requests[1], None)])
    assert isinstance(answers[0], DecodeAbandoned)
    assert isinstance(answers[1], DecodeResult) and torch.equal(answers[1].output, expected)


class AbandonedAfter(threading.Event):
    """Set once the call checked it `steps` times (its requests went away meanwhile)."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.checks = steps, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks > self.steps


@pytest.mark.parametrize("steps", [1, 2])
def test_a_model_whose_own_decode_calls_its_decoder_several_times_stops_between_calls(steps):
    """HunyuanVideo's `decode` runs its decoder once per overlapping temporal tile (3 for 9 latent
    frames): an abandoned call stops before the next of them, not after the whole clip."""
    engine = DecodeEngine(ServiceConfig(model="tiny-hunyuan-video", device="cpu", cpu_threads=1))
    forwards = []
    engine.vae.decoder.register_forward_hook(lambda *_: forwards.append(1))
    z = torch.randn(1, engine.spec.latent_channels, 9, 4, 4, generator=torch.Generator().manual_seed(3))
    prepared = engine.prepare(DecodeRequest(z))
    engine.decode([prepared])
    assert len(forwards) == 3
    forwards.clear()
    (result,) = engine.decode([prepared], AbandonedAfter(steps))
    assert isinstance(result, DecodeAbandoned)  # the request's answer: nobody waits for it
    assert len(forwards) == steps
