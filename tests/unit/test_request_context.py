"""One request context from admission to the last tile: its deadline (fixed at admission, queue time
included), its abandonment, its live limits and the engine's fingerprint (which a replica that would
decode other bits refuses a tile by: tests/unit/test_shared_tiles.py)."""

import asyncio
import threading
import time

import pytest
import torch

from tests.models import torch_threads
from vae_service.config import Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.request.context import WAIT_SLICE_S, RequestContext
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout, LimitExceeded, Overloaded
from vae_service.models.loading import LoadedVae
from vae_service.serving.decode_service import DecodeService


def engine(folder, **config) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(**{"model": str(folder), "device": "cpu", "cpu_threads": 1, **config}))


@pytest.fixture(scope="module")
def kl_engines(kl_dir, tmp_path_factory):
    from tests.models import build_full_vae, save_vae

    other_weights = save_vae(build_full_vae("kl", seed=7), tmp_path_factory.mktemp("kl-other"))
    return {
        "here": engine(kl_dir),
        "same": engine(kl_dir),
        "other weights": engine(other_weights),
        "other precision": engine(kl_dir, decode_precision="bf16"),
        "other thread count": engine(kl_dir, cpu_threads=2),
        "other fast path": engine(kl_dir, fast_path={"disable": ["upsample_fold"]}),
    }


def latents(engine: DecodeEngine, h: int, w: int) -> torch.Tensor:
    return torch.randn(1, engine.spec.latent_channels, h, w, generator=torch.Generator().manual_seed(0))


def test_fingerprints_differ_exactly_where_the_bits_would(kl_engines):
    prints = {name: e.fingerprint for name, e in kl_engines.items()}
    assert prints["here"] == prints["same"]  # another engine of the same folder and settings
    assert len(set(prints.values())) == len(prints) - 1  # every other difference is seen
    parts = kl_engines["here"].describe()["fingerprint"]
    assert parts["digest"] == prints["here"] and parts["cpu_threads"] == 1 and parts["precision"] == "fp32"


def test_replicas_of_one_model_agree_on_its_fingerprint_whatever_the_process():
    """diffusers' bookkeeping keys (`_use_default_values` is a set's order, which varies with each
    process's hash seed; `_name_or_path` with where a node loaded the folder) never split replicas
    of one model into fingerprints that refuse each other's tiles."""
    from vae_service.models import load_vae
    from vae_service.models.probe_cache import config_digest
    from vae_service.models.spec import jsonable_config

    config = jsonable_config(load_vae("tiny-kl", name="kl").vae)
    assert len(config["_use_default_values"]) > 1  # a set's order: another process lists it otherwise
    other_process = {**config, "_use_default_values": config["_use_default_values"][::-1], "_name_or_path": "/x"}
    assert config_digest(config) == config_digest(other_process)
    assert config_digest(config) != config_digest({**config, "scaling_factor": 0.5})  # what decodes still counts


def test_the_items_of_a_request_nobody_waits_for_are_not_decoded(kl_engines, monkeypatch):
    """A lossless batch of two requests, the first already past its deadline: it is answered 504
    without a decoder call; the second decodes as usual."""
    here = kl_engines["here"]
    calls = []
    hook = here.vae.decoder.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    try:
        z = latents(here, 6, 6)
        late = here.prepare(DecodeRequest(z.repeat(3, 1, 1, 1), latents_scaled=True), here.context(timeout_s=60))
        prompt = here.prepare(DecodeRequest(z.repeat(3, 1, 1, 1), latents_scaled=True), here.context(timeout_s=60))
        late.context.deadline = time.monotonic()  # passed once admitted and priced, however slow the machine
        with torch_threads(1):
            first, second = here.decode([late, prompt])
    finally:
        hook.remove()
    assert isinstance(first, DecodeTimeout) and second.output.shape[0] == 3
    assert calls == [1, 1, 1]  # the second request's three items alone; none of the first's


def test_a_request_whose_deadline_passes_mid_decode_stops_at_its_next_item(kl_engines):
    here = kl_engines["here"]
    context = here.context(timeout_s=0.5)
    prepared = here.prepare(DecodeRequest(latents(here, 6, 6).repeat(4, 1, 1, 1), latents_scaled=True), context)
    calls = []

    def slow(module, args):
        calls.append(1)
        while not context.expired:  # the first item outlives the request
            time.sleep(0.01)

    hook = here.vae.decoder.register_forward_pre_hook(slow)
    try:
        with torch_threads(1):
            (result,) = here.decode([prepared])
    finally:
        hook.remove()
    assert isinstance(result, DecodeTimeout) and calls == [1]  # a fresh timeout per item: never


async def test_the_context_is_fixed_at_admission_under_the_live_settings_of_that_moment(kl_dir):
    service = DecodeService(
        ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1, batching={"request_timeout_s": 40})
    )
    before = time.monotonic()
    context = service.admit()
    service.apply(LiveConfig(limits=Limits(max_batch_items=1), batching={"request_timeout_s": 5}))
    assert before + 40 <= context.deadline <= time.monotonic() + 40 and context.limits.max_batch_items == 16
    assert context.fingerprint == service.engine.fingerprint
    two = DecodeRequest(torch.zeros(2, 4, 4, 4))
    assert service.engine.check(two, context).items == 2  # admitted under the old limits
    with pytest.raises(LimitExceeded, match="max_batch_items"):
        service.engine.check(two, service.admit())  # a new request: the new ones


async def test_a_full_queue_answers_the_configured_retry_after_and_a_request_larger_than_it_413(kl_dir):
    config = ServiceConfig(
        model=str(kl_dir),
        device="cpu",
        cpu_threads=1,
        batching={"max_queued_items": 2, "max_batch_size": 1},
        serving={"retry_after_s": 7},
    )
    service = DecodeService(config)
    inside, release = threading.Event(), threading.Event()

    def hold(module, args):
        inside.set()
        release.wait(30)

    hook = service.engine.vae.decoder.register_forward_pre_hook(hold)
    z = torch.zeros(1, 4, 4, 4)
    try:
        running = asyncio.ensure_future(service.decode(DecodeRequest(z)))
        assert await asyncio.to_thread(inside.wait, 30)
        queued = [asyncio.ensure_future(service.decode(DecodeRequest(z))) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded) as full:
            await service.decode(DecodeRequest(z))
        with pytest.raises(LimitExceeded, match=r"batching\.max_queued_items") as never:
            await service.decode(DecodeRequest(torch.zeros(3, 4, 4, 4)))
    finally:
        release.set()
        hook.remove()
    await asyncio.gather(running, *queued)
    from vae_service.protocol.errors import wire_error

    assert full.value.retry_after_s == 7 and wire_error(full.value).http_headers()["Retry-After"] == "7"
    assert wire_error(never.value).http_status == 413


async def test_prices_that_run_the_twin_are_made_on_the_pricing_thread_and_the_others_inline(kl_dir, wide_kl_vae):
    """CPU fp32 `high` of a 64-channel decoder (Winograd) is priced per shape on the twin: on the
    service's pricing thread; `lossless` of it, priced by formula, on the event loop's own thread."""
    config = ServiceConfig(model="kl64", device="cpu", cpu_threads=1)
    service = DecodeService(config, DecodeEngine(config, LoadedVae.of(wide_kl_vae)))
    engine, threads = service.engine, []
    price = engine.price

    def recorded(prepared):
        threads.append(threading.current_thread().name)
        return price(prepared)

    engine.price = recorded
    z = torch.zeros(1, 4, 13, 11)
    await service.decode(DecodeRequest(z, quality="high"))
    await service.decode(DecodeRequest(z))
    assert threads[0].startswith("vae-price") and threads[1] == threading.current_thread().name


def test_waits_check_the_request_between_slices():
    context = RequestContext.admit(60, Limits())
    slices = []

    def never(slice_s):
        slices.append(slice_s)
        if len(slices) == 3:
            context.abandon()
        return False

    with pytest.raises(DecodeAbandoned):
        context.wait_until(never, "a test wait")
    assert len(slices) == 3 and max(slices) <= WAIT_SLICE_S
    stopped = []
    context2 = RequestContext.admit(60, Limits())
    context2.on_end(lambda: stopped.append(1))
    context2.abandon()
    context2.on_end(lambda: stopped.append(2))  # registered after the end: called at once
    assert stopped == [1, 2]


async def test_prices_waiting_for_the_pricing_thread_are_bounded_then_429_with_retry_after(kl_dir):
    from vae_service.serving.scheduling.request_pricing import PRICING_QUEUE

    config = ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1, serving={"retry_after_s": 3})
    service = DecodeService(config)
    engine, release, started = service.engine, threading.Event(), threading.Event()
    price = engine.price

    def held(prepared):  # injected: a price that runs the twin for a long time
        started.set()
        release.wait(30)
        return price(prepared)

    engine.needs_shape_work, engine.price = (lambda prepared: True), held
    z = torch.zeros(1, 4, 4, 4)
    waiting = [asyncio.ensure_future(service.decode(DecodeRequest(z))) for _ in range(PRICING_QUEUE)]
    try:
        assert await asyncio.to_thread(started.wait, 30)
        with pytest.raises(Overloaded, match="wait for a price") as refused:
            await service.decode(DecodeRequest(z))
    finally:
        release.set()
    assert refused.value.retry_after_s == 3
    assert len(await asyncio.gather(*waiting)) == PRICING_QUEUE  # those admitted are answered


async def test_a_price_its_caller_gave_up_on_holds_its_place_in_the_queue_until_its_thread_stops(kl_dir):
    """The pricing queue counts running work: a caller that timed out frees nothing while the
    thread still runs its price, so later requests are refused (429), not queued behind it; a
    price cancelled before it began frees its place at once."""
    from vae_service.serving.scheduling.request_pricing import PRICING_QUEUE

    config = ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1, batching={"request_timeout_s": 0.3})
    service = DecodeService(config)
    engine, release = service.engine, threading.Event()
    price = engine.price

    def held(prepared):  # injected: a price whose work outlives its caller's deadline
        release.wait(30)
        return price(prepared)

    engine.needs_shape_work, engine.price = (lambda prepared: True), held
    z = torch.zeros(1, 4, 4, 4)
    try:
        with pytest.raises(DecodeTimeout):
            await service.decode(DecodeRequest(z))  # its price runs on
        assert service.pricing.pricing_held == 1
        answers = await asyncio.gather(
            *(service.decode(DecodeRequest(z)) for _ in range(PRICING_QUEUE)), return_exceptions=True
        )
        assert all(isinstance(a, DecodeTimeout) for a in answers[:-1])  # waited behind it, then left
        assert isinstance(answers[-1], Overloaded)  # the running price still had its place
        assert service.pricing.pricing_held == 1  # those that never began are gone from the count
    finally:
        release.set()
    await asyncio.to_thread(service.pricing.pricing.submit(lambda: None).result, 30)
    assert service.pricing.pricing_held == 0
