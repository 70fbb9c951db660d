"""The replica core without Ray: concurrent requests, live settings, fixed model and precision."""

import asyncio
import json
import threading
import types

import msgpack
import numpy as np
import pytest
import torch

from tests.models import load_reference, reference_decode, torch_threads
from vae_service.config import Batching, Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeRequest, DecodeTimeout, LimitExceeded
from vae_service.engine.media.encoding import encode_item
from vae_service.engine.request.errors import DecodeAbandoned
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.replica import parse_live
from vae_service.serving.wire.http_routes import decode_answer
from vae_service_client.messages import MSGPACK, DecodeResponse, pack, request_map


async def test_concurrent_lossless_requests_are_bit_identical_to_solo_decodes(kl_dir, kl_reference):
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu"))
    gen = torch.Generator().manual_seed(7)
    latents = [torch.randn(b, 4, 4, 5, generator=gen) for b in (1, 3, 2, 1, 2)]
    results = await asyncio.gather(
        *(
            service.decode(DecodeRequest(z, latents_scaled=True, output="float", request_id=str(i)))
            for i, z in enumerate(latents)
        )
    )
    for i, (z, result) in enumerate(zip(latents, results, strict=True)):
        assert result.request_id == str(i) and (result.model, result.precision) == ("kl", "fp32")
        assert torch.equal(result.output, reference_decode(kl_reference, z))
        assert result.timing.queue_ms >= 0 and result.timing.decode_ms > 0
    assert max(r.timing.batch_size for r in results) > max(z.shape[0] for z in latents)  # some were batched


async def test_live_settings_apply_in_place(kl_dir):
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu"))
    engine = service.engine
    service.apply(LiveConfig(limits=Limits(max_batch_items=1), batching=Batching(max_batch_size=3)))
    assert service.engine is engine and service.scheduler.limits.max_batch_size == 3
    with pytest.raises(LimitExceeded, match="max_batch_items"):
        await service.decode(DecodeRequest(torch.zeros(2, 4, 2, 2)))
    assert (await service.decode(DecodeRequest(torch.zeros(1, 4, 2, 2)))).output.shape == (1, 16, 16, 3)


@pytest.mark.parametrize("field", ["decode_precision", "model", "device", "seed", "fast_path", "serving"])
def test_user_config_cannot_change_what_is_fixed_per_replica(field):
    with pytest.raises(ValueError, match=rf"\['{field}'\] are fixed.*roll replicas.*\['limits', 'batching'\]"):
        parse_live({field: ServiceConfig.model_fields[field].default, "limits": {}})


def test_user_config_takes_limits_and_batching():
    live = parse_live({"limits": {"max_batch_items": 2}, "batching": {"batch_wait_ms": 3}})
    assert live.limits.max_batch_items == 2 and live.batching.batch_wait_ms == 3
    with pytest.raises(ValueError, match="max_batch_itemz"):
        parse_live({"limits": {"max_batch_itemz": 2}})


DEPLOYED = ServiceConfig(batching={"request_timeout_s": 60, "max_batch_size": 8}, serving={"concurrent_keys": 4})
ENFORCED = DEPLOYED.deployment_options() | {"graceful_shutdown_timeout_s": 65}  # what Serve was given at deploy


@pytest.mark.parametrize(
    "batch, keys, connections, room",
    [(8, 4, 16, 16), (8, 4, 30, 24), (3, 2, 5, 3), (1, 1, 16, 0), (2, 3, 4, 4), (8, 4, 0, 0)],
)
def test_session_connections_leave_a_full_batch_of_decode_slots(batch, keys, connections, room):
    """A WebSocket or DecodeSession call is one of Serve's ongoing requests for its whole life:
    a replica holds at most `sessions.max_connections` of them, and never so many that a full batch
    could not still be decoded beside them; Serve's pool stays the decode slots."""
    config = ServiceConfig(batching={"max_batch_size": batch}, serving={"concurrent_keys": keys},
                           sessions={"max_connections": connections})  # fmt: skip
    assert config.session_connections == room
    assert config.deployment_options()["max_ongoing_requests"] == batch * keys
    assert config.deployment_options()["max_ongoing_requests"] - room >= batch


@pytest.mark.parametrize(
    "batching, field",
    [
        ({"request_timeout_s": 61}, "batching.request_timeout_s"),
        ({"request_timeout_s": 60, "max_batch_size": 9}, "batching.max_batch_size"),
    ],
)
def test_a_live_change_that_contradicts_an_option_fixed_at_deploy_is_refused_naming_it(batching, field):
    """Raising the timeout live would let Serve kill a draining replica with its requests (its
    graceful shutdown was derived from the old one); a larger batch than max_ongoing_requests
    admits could never fill. Lowering either is a live change like any other."""
    lowered = parse_live({"batching": {"request_timeout_s": 30, "max_batch_size": 4}}, DEPLOYED, ENFORCED)
    assert (lowered.batching.request_timeout_s, lowered.batching.max_batch_size) == (30, 4)
    with pytest.raises(ValueError, match=rf"user_config: {field}"):
        parse_live({"batching": batching}, DEPLOYED, ENFORCED)


def test_a_replica_refuses_such_a_change_when_serve_reconfigures_it(kl_dir):
    from vae_service.serving.replica import DecoderReplica

    replica = DecoderReplica(DEPLOYED.model_copy(update={"model": str(kl_dir), "cpu_threads": 1}), ENFORCED)
    replica.reconfigure({"batching": {"request_timeout_s": 20}})
    assert replica.service.config.batching.request_timeout_s == 20
    with pytest.raises(ValueError, match=r"batching\.request_timeout_s"):
        replica.reconfigure({"batching": {"request_timeout_s": 600}})
    assert replica.service.config.batching.request_timeout_s == 20  # unchanged


def test_the_drain_waits_within_the_shutdown_timeout_serve_enforces():
    from vae_service.config import SHUTDOWN_MARGIN_S
    from vae_service.serving.replica import drain_timeout_s

    live = LiveConfig(batching={"request_timeout_s": 120})
    assert drain_timeout_s(live, {"graceful_shutdown_timeout_s": 30}) == 30 - SHUTDOWN_MARGIN_S
    assert drain_timeout_s(live, {"graceful_shutdown_timeout_s": 300}) == 120
    assert drain_timeout_s(live, {}) == 120


async def test_batches_run_on_one_device_thread_with_the_engines_thread_count(kl_dir, kl_vae):
    """torch keeps its CPU thread count per thread: the device thread must decode with the
    configured count whatever the thread that built the service uses (lossless bits depend on it)."""
    before = torch.get_num_threads()
    try:
        service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1))
        torch.set_num_threads(2)  # e.g. the serving framework's own threads
        seen = []
        decode = service.engine.decode

        def recording(batch, abandoned=None, turn=None):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return decode(batch, abandoned)

        service.scheduler.run_batch = recording
        z = torch.randn(1, 4, 3, 3, generator=torch.Generator().manual_seed(2))
        outs = [await service.decode(DecodeRequest(z, latents_scaled=True, output="float")) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    assert {name.split("_")[0] for name, _ in seen} == {"vae-device"} and {n for _, n in seen} == {1}
    with torch_threads(1):
        expected = reference_decode(load_reference(kl_dir), z)  # not kl_vae: tests/models.py load_reference
    assert all(torch.equal(o.output, expected) for o in outs)
    assert service.describe()["cpu_threads"] == 1


@pytest.mark.parametrize("at_start", [True, False])
def test_the_class_tiled_price_is_fitted_beside_start_up_unless_configured_not_to(kl_dir, at_start):
    from vae_service.engine import DecodeEngine
    from vae_service.models.probe_cache import ProbeCache

    config = ServiceConfig(
        model=str(kl_dir), device="cpu", cpu_threads=1, serving={"fit_prices_at_start": at_start},
        limits={"max_decode_bytes": 8 * 2**20},
    )  # fmt: skip
    engine = DecodeEngine(config, probes=ProbeCache())  # nothing fitted by another test
    service = DecodeService(config, engine)
    service.pricing.pricing.submit(lambda: None).result()  # after what start-up queued on the pricing thread
    assert (engine.cost.class_tiled_fitted is not None) == at_start
    request = DecodeRequest(torch.zeros(1, 4, 40, 40), latents_scaled=True)  # lossless above the bound
    checked = engine.check(request)
    assert engine.needs_shape_work(checked) != at_start  # without the fit, its price waits for it
    assert engine.price(checked).tiling is not None and engine.cost.class_tiled_fitted is not None


def kl_service(kl_dir, **config) -> DecodeService:
    return DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1, **config))


async def test_out_of_memory_retries_the_batch_item_by_item_then_answers_503_with_retry_after(kl_dir, kl_reference):
    service = kl_service(kl_dir, batching={"batch_wait_ms": 50}, serving={"retry_after_s": 3})
    calls, decode = [], service.engine.decode

    # injected: the device fits one item, and never the marked one
    def short_of_memory(batch, abandoned=None, turn=None):
        calls.append([r.request.request_id for r in batch])
        if len(batch) > 1 or batch[0].request.request_id == "huge":
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return decode(batch)

    service.scheduler.run_batch = short_of_memory
    z = torch.randn(3, 4, 3, 3, generator=torch.Generator().manual_seed(4))
    bodies = [
        pack(request_map(z[i : i + 1], output="float", scaling_factor=None, request_id=rid))
        for i, rid in enumerate(("a", "huge", "b"))
    ]
    answers = await asyncio.gather(*(decode_answer(service, b, MSGPACK) for b in bodies))
    # one batch first (prepared off the event loop: in any order), then each request alone
    assert sorted(calls[0]) == ["a", "b", "huge"] and sorted(map(tuple, calls[1:])) == [("a",), ("b",), ("huge",)]
    ok = {a.status for i, a in enumerate(answers) if i != 1}
    assert ok == {200} and answers[1].status == 503 and answers[1].headers == {"Retry-After": "3"}
    assert json.loads(answers[1].body)["error"]["type"] == "out_of_memory"
    with torch_threads(1):
        expected = reference_decode(kl_reference, z[[0, 2]])
    outputs = [DecodeResponse.from_map(msgpack.unpackb(answers[i].body)).output for i in (0, 2)]
    np.testing.assert_array_equal(np.concatenate(outputs), expected.numpy())


async def test_decoder_nan_answers_422_for_that_request_alone(kl_dir, monkeypatch):
    service = kl_service(kl_dir, batching={"batch_wait_ms": 50})
    decode = service.engine.vae.decode

    def overflowing(z, *args, **kwargs):
        out = decode(z, *args, **kwargs)
        out.sample[(z == 7.0).flatten(1).any(1)] = float("nan")
        return out

    monkeypatch.setattr(service.engine.vae, "decode", overflowing)
    latents = [torch.zeros(1, 4, 2, 2), torch.full((1, 4, 2, 2), 7.0), torch.ones(1, 4, 2, 2)]
    answers = await asyncio.gather(
        *(decode_answer(service, pack(request_map(z, "high", scaling_factor=None)), MSGPACK) for z in latents)
    )
    assert [a.status for a in answers] == [200, 422, 200]
    error = json.loads(answers[1].body)["error"]
    assert (error["type"], error["field"]) == ("decode_failed", "latents")
    assert DecodeResponse.from_map(msgpack.unpackb(answers[0].body)).timing["batch_size"] == 3  # one shared call


async def test_one_batch_on_the_device_at_a_time(kl_dir):
    """Counted, not timed: the first batch is held on the device while the others wait and the event
    loop takes many turns, in which a batcher that started batches side by side would enter the
    runner again."""
    service = kl_service(kl_dir, batching={"max_batch_size": 2})
    run, lock = service.scheduler.run_batch, threading.Lock()
    inside, widest, qualities, sizes = [0], [0], [], []
    first_in, release = threading.Event(), threading.Event()

    def counted(batch, abandoned=None, turn=None):
        with lock:
            inside[0] += 1
            widest[0] = max(widest[0], inside[0])
            qualities.append({r.batch_key.quality for r in batch})
            sizes.append([r.items for r in batch])
        first_in.set()
        try:
            assert release.wait(30), "the test never released the first batch"
            return run(batch, abandoned, turn)
        finally:
            with lock:
                inside[0] -= 1

    service.scheduler.run_batch = counted
    gen = torch.Generator().manual_seed(9)
    requests = [
        DecodeRequest(torch.randn(1, 4, 4, 4, generator=gen), quality=("high", "lossless")[i % 2]) for i in range(12)
    ]
    answers = asyncio.gather(*(service.decode(r) for r in requests))
    assert await asyncio.to_thread(first_in.wait, 30)
    for _ in range(200):  # turns in which a batcher that does not wait would start the next batch
        await asyncio.sleep(0)
    release.set()
    results = await answers
    assert [r.quality for r in results] == [r.quality for r in requests]
    assert sum(map(len, sizes)) == len(requests) and len(qualities) >= 6
    assert all(len(q) == 1 for q in qualities)  # a batch never mixes tiers
    assert set().union(*qualities) == {"high", "lossless"}
    assert widest[0] == 1


def jumpable_clocks(monkeypatch, service: DecodeService):
    """The event loop's clock (it times request deadlines) and the batcher's run on as usual, plus
    jumps the test makes: a deadline passes exactly when the test says, not after a real wait."""
    loop, jump = asyncio.get_running_loop(), [0.0]
    loop_time, batcher_clock = loop.time, service.scheduler.clock
    monkeypatch.setattr(loop, "time", lambda: loop_time() + jump[0])
    monkeypatch.setattr(service.scheduler, "clock", lambda: batcher_clock() + jump[0])

    def advance(seconds: float) -> None:
        jump[0] += seconds

    return advance


def hold_in_frame(service: DecodeService, frame: int):
    """Counts the Wan decoder's runs (its mid-block attention runs once per latent frame, whichever
    way the chunk runs) and holds the device thread inside latent frame `frame` until the batcher
    has told the decode that its callers all left. Returns (calls, reached, watch): `watch` has
    `saw_abandoned` (the held frame saw the event), `outcome` (what the batch runner returned or
    raised) and `finished` (set once the runner returned)."""
    calls, reached = [], threading.Event()
    watch = types.SimpleNamespace(abandoned=[], saw_abandoned=[], outcome=[], finished=threading.Event())
    run = service.scheduler.run_batch

    def watched(batch, abandoned=None, turn=None):
        watch.abandoned.append(abandoned)
        try:
            watch.outcome.append(run(batch, abandoned, turn))
        except Exception as exc:
            watch.outcome.append(exc)
            raise
        finally:
            watch.finished.set()
        return watch.outcome[-1]

    def count(module, args):
        calls.append(1)
        if len(calls) == frame:
            reached.set()
            watch.saw_abandoned.append(watch.abandoned[-1].wait(30))

    service.scheduler.run_batch = watched
    service.engine.vae.decoder.mid_block.attentions[0].register_forward_pre_hook(count)
    return calls, reached, watch


@pytest.mark.parametrize("how", ["client went away", "request timed out"])
async def test_a_decode_whose_callers_left_stops_at_its_next_latent_frame(wan_dir, monkeypatch, how):
    """One request must not hold the device after it is abandoned: the decode is held inside its
    third latent frame until the service has seen its caller leave, then finishes that frame and
    starts no other (the engine looks before each latent frame)."""
    service = DecodeService(
        ServiceConfig(
            model=str(wan_dir), model_name="wan", device="cpu", cpu_threads=1, batching={"request_timeout_s": 3600}
        )
    )
    advance = jumpable_clocks(monkeypatch, service)
    frames, held = 40, 3
    calls, reached, watch = hold_in_frame(service, held)
    task = asyncio.create_task(service.decode(DecodeRequest(torch.zeros(1, 4, frames, 2, 2), quality="high")))
    assert await asyncio.to_thread(reached.wait, 30)
    if how == "client went away":
        task.cancel()
    else:
        advance(3600)  # the deadline passes while the device is inside the clip
    with pytest.raises(asyncio.CancelledError if how == "client went away" else DecodeTimeout):
        await task
    assert await asyncio.to_thread(watch.finished.wait, 30)
    assert watch.saw_abandoned == [True]
    assert len(calls) == held  # the held frame finished; no further frame started
    (outcome,) = watch.outcome  # the batch's results: the request's is its abandonment
    assert [type(o) for o in outcome] == [DecodeAbandoned]
    ok = await service.decode(DecodeRequest(torch.zeros(1, 4, 1, 2, 2)))  # and the device is free again
    assert ok.output.shape == (1, 1, 16, 16, 3)


async def test_slow_encoding_never_holds_the_device(kl_dir):
    """16 png requests while every encoder is held: exactly the pool's 4 encode at once, and the
    device goes on decoding the others meanwhile (counted, not timed)."""
    service = kl_service(kl_dir, encoding={"threads": 4}, batching={"max_batch_size": 1})
    decode, lock = service.engine.decode, threading.Lock()
    decoded, encoding, widest = [0], [0], [0]
    pool_full, eight_decoded, release = threading.Event(), threading.Event(), threading.Event()

    def counted_decode(batch, abandoned=None, turn=None):
        out = decode(batch, abandoned)
        with lock:
            decoded[0] += 1
            if decoded[0] >= 8 and pool_full.is_set():
                eight_decoded.set()
        return out

    def held_encode(item, fmt, settings, fragments):
        with lock:
            encoding[0] += 1
            widest[0] = max(widest[0], encoding[0])
            if encoding[0] == 4:
                pool_full.set()
        release.wait(30)
        with lock:
            encoding[0] -= 1
        return encode_item(item, fmt, settings, fragments)

    service.scheduler.run_batch, service.encoders.encode_item = counted_decode, held_encode
    gen = torch.Generator().manual_seed(14)
    requests = asyncio.gather(
        *(service.decode(DecodeRequest(torch.randn(1, 4, 2, 2, generator=gen), output="png")) for _ in range(16))
    )
    assert await asyncio.to_thread(pool_full.wait, 30)  # four encodes running, all held
    assert await asyncio.to_thread(eight_decoded.wait, 30)  # and the device decoded on meanwhile
    release.set()
    results = await requests
    assert all(isinstance(r.output, list) and r.output[0].startswith(b"\x89PNG") for r in results)
    assert widest[0] == 4 and decoded[0] == 16  # the pool's width, never more


async def test_a_failed_encode_fails_only_its_request_and_nothing_is_decoded_again(kl_dir):
    service = kl_service(kl_dir, batching={"batch_wait_ms": 50})
    decode, calls = service.engine.decode, []
    broken = DecodeRequest(torch.zeros(1, 4, 2, 2), output="png")  # its pixels are recognisable
    bad_pixels = service.engine.decode([service.engine.prepare(broken)])[0].output[0].numpy()

    def counting(batch, abandoned=None, turn=None):
        calls.append(len(batch))
        return decode(batch, abandoned)

    def encode_or_break(item, fmt, settings, fragments):
        if np.array_equal(item, bad_pixels):
            raise OSError("injected: the encoder broke")
        return encode_item(item, fmt, settings, fragments)

    service.scheduler.run_batch, service.encoders.encode_item = counting, encode_or_break
    gen = torch.Generator().manual_seed(15)
    bodies = [
        pack(request_map(torch.randn(1, 4, 2, 2, generator=gen), output="png")),
        pack(request_map(torch.zeros(1, 4, 2, 2), output="png")),
        pack(request_map(torch.randn(1, 4, 2, 2, generator=gen), output="png")),
    ]
    answers = await asyncio.gather(*(decode_answer(service, b, MSGPACK) for b in bodies))
    assert [a.status for a in answers] == [200, 500, 200]
    error = json.loads(answers[1].body)["error"]
    assert error["type"] == "internal" and "error id" in error["message"] and "injected" not in error["message"]
    assert calls == [3]  # one decode of the batch, never repeated
