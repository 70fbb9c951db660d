"""One request context from admission to the last tile: its deadline (fixed at admission, queue time
included), its abandonment, its live limits and the engine's fingerprint, which a replica that would
decode other bits refuses a tile by (the tile is then decoded where the request is: never blended).
Replicas are other engines on this machine; the transport is a fake of Serve's handle only."""

import asyncio
import threading
import time

import pytest
import torch

from tests.models import torch_threads
from vae_service.config import Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.call import TileCall
from vae_service.engine.context import WAIT_SLICE_S, RequestContext
from vae_service.engine.errors import DecodeAbandoned, DecodeTimeout, LimitExceeded, Overloaded
from vae_service.models.loading import LoadedVae
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.tile_spread import ReplicaTiles, TileAnswer, sub_decode_context

SPREAD = {"min_output_pixels": 48 * 48}  # tiles of 8 latent pixels


def engine(folder, **config) -> DecodeEngine:
    settings = {"model": str(folder), "device": "cpu", "cpu_threads": 1, "parallel": SPREAD, **config}
    return DecodeEngine(ServiceConfig(**settings))


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


@pytest.fixture(scope="module")
def wan_engines(wan_dir):
    return {"here": engine(wan_dir), "same": engine(wan_dir), "other thread count": engine(wan_dir, cpu_threads=2)}


def test_fingerprints_differ_exactly_where_the_bits_would(kl_engines):
    prints = {name: e.fingerprint for name, e in kl_engines.items()}
    assert prints["here"] == prints["same"]  # another engine of the same folder and settings
    assert len(set(prints.values())) == len(prints) - 1  # every other difference is seen
    parts = kl_engines["here"].describe()["fingerprint"]
    assert parts["digest"] == prints["here"] and parts["cpu_threads"] == 1 and parts["precision"] == "fp32"


class Response:
    """Serve's DeploymentResponse, as far as the spreader uses it."""

    def __init__(self, answer=None, hang: bool = False):
        self.answer, self.hang, self.cancelled = answer, hang, threading.Event()

    def _to_object_ref_sync(self, _timeout_s=None):
        pass

    def result(self, timeout_s=None):
        if self.hang:
            if self.cancelled.wait(timeout_s):
                raise RuntimeError("cancelled")
            raise TimeoutError
        return self.answer

    def cancel(self):
        self.cancelled.set()


class Stream:
    def __init__(self, answers):
        self.answers, self.cancelled = iter(answers), threading.Event()

    def _to_object_ref_gen_sync(self, _timeout_s=None):
        pass

    def __next__(self):
        return next(self.answers)

    def cancel(self):
        self.cancelled.set()


class Peer:
    """A deployment handle whose replica is `peer`: the replica's own sub-decode logic (refuse
    another fingerprint, else decode), run at once. `hang`: its image tiles never answer."""

    def __init__(self, peer: DecodeEngine, hang: bool = False):
        self.peer, self.hang, self.sent = peer, hang, []

    def options(self, stream: bool = False):
        return self

    @property
    def decode_tile(self):
        return self

    @property
    def decode_tile_chunks(self):
        return _Chunks(self)

    def remote(self, tile, part, fingerprint, remaining_s):
        if self.hang:
            self.sent.append(Response(hang=True))
            return self.sent[-1]
        context = sub_decode_context(fingerprint, remaining_s, self.peer.fingerprint)
        if isinstance(context, str):
            return Response(TileAnswer(None, "peer", context))
        self.sent.append(None)
        with torch_threads(self.peer.runtime.cpu_threads):  # two replica names: `replicas` counts 2
            return Response(
                TileAnswer(self.peer.decode_tile(tile, part, fingerprint).cpu(), f"peer-{len(self.sent) % 2}")
            )


class _Chunks:
    def __init__(self, handle: Peer):
        self.handle = handle

    def remote(self, tile, quality, timestep, fingerprint, remaining_s):
        peer = self.handle.peer
        context = sub_decode_context(fingerprint, remaining_s, peer.fingerprint)
        if isinstance(context, str):
            return Stream([TileAnswer(None, "peer", context)])
        self.handle.sent.append(None)
        with torch_threads(peer.runtime.cpu_threads):
            chunks = [c.cpu() for c in peer.tile_chunks(tile, quality, timestep, fingerprint)]
        return Stream([TileAnswer(c, f"peer-{len(self.handle.sent) % 2}") for c in chunks])


def spreader_to(handle: Peer) -> ReplicaTiles:
    spread = ReplicaTiles(retry_after_s=1.0)
    spread._handle = handle
    return spread


def latents(engine: DecodeEngine, h: int, w: int, frames: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dims = (frames,) if frames else ()
    return torch.randn(1, engine.spec.latent_channels, *dims, h, w, generator=g)


@pytest.mark.parametrize("peer", ["same", "other weights", "other precision", "other thread count", "other fast path"])
def test_a_replica_that_decodes_other_bits_refuses_the_tiles_and_they_are_decoded_here(kl_engines, peer):
    here = kl_engines["here"]
    request = DecodeRequest(latents(here, 17, 13, seed=3), quality="high", output="float", latents_scaled=True)
    with torch_threads(1):
        prepared = here.prepare(request)
        assert len(prepared.tiling.tiles()) >= 2
        (alone,) = here.decode([prepared])
        (spread,) = here.decode([prepared], spread=spreader_to(Peer(kl_engines[peer])))
    assert torch.equal(spread.output, alone.output)  # never blended from another model's bits
    assert spread.timing.replicas == (2 if peer == "same" else 1)  # `same` decoded them; the others refused


@pytest.mark.parametrize("peer", ["same", "other thread count"])
def test_a_video_tile_refused_by_a_replica_is_streamed_from_here(wan_engines, peer):
    here = wan_engines["here"]
    request = DecodeRequest(latents(here, 14, 11, frames=3, seed=4), quality="high", latents_scaled=True)
    with torch_threads(1):
        prepared = here.prepare(request)
        assert prepared.tiling is not None
        (alone,) = here.decode([prepared])
        (spread,) = here.decode([prepared], spread=spreader_to(Peer(wan_engines[peer])))
    assert torch.equal(spread.output, alone.output)
    assert spread.timing.replicas == (2 if peer == "same" else 1)


def test_a_sub_decode_without_time_left_is_refused():
    assert isinstance(sub_decode_context("a" * 16, 0.0, "a" * 16), str)
    assert isinstance(sub_decode_context("a" * 16, 5.0, "b" * 16), str)
    context = sub_decode_context("a" * 16, 5.0, "a" * 16)
    assert 4.0 < context.remaining() <= 5.0  # the request's own deadline, carried over


def decode_in_thread(engine: DecodeEngine, prepared, spread) -> tuple[list, threading.Event]:
    out, done = [], threading.Event()

    def run():
        with torch_threads(1):
            out.append(engine.decode([prepared], spread=spread)[0])
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return out, done


def test_a_client_that_leaves_while_tiles_are_out_frees_the_device_thread_within_a_slice(kl_engines):
    here = kl_engines["here"]
    handle = Peer(kl_engines["same"], hang=True)
    context = here.context(timeout_s=120)
    request = DecodeRequest(latents(here, 17, 13), quality="high", latents_scaled=True)
    prepared = here.prepare(request, context)
    out, done = decode_in_thread(here, prepared, spreader_to(handle))
    deadline = time.monotonic() + 30
    while not handle.sent and time.monotonic() < deadline:  # the tiles are out
        time.sleep(0.01)
    assert handle.sent and not done.is_set()
    context.abandon()
    assert done.wait(20 * WAIT_SLICE_S + 5)  # within a slice of waiting (and CPU scheduling), not 120 s
    assert isinstance(out[0], DecodeAbandoned)
    assert all(r.cancelled.is_set() for r in handle.sent)  # every sub-decode sent is cancelled


def test_a_tile_that_never_answers_ends_at_the_request_deadline_with_504(kl_engines):
    here = kl_engines["here"]
    context = here.context(timeout_s=1.0)
    prepared = here.prepare(DecodeRequest(latents(here, 17, 13), quality="high", latents_scaled=True), context)
    out, done = decode_in_thread(here, prepared, spreader_to(Peer(kl_engines["same"], hang=True)))
    assert done.wait(30)
    assert isinstance(out[0], DecodeTimeout) and not isinstance(out[0], DecodeAbandoned)  # 504: not a 503


def test_the_items_of_a_request_nobody_waits_for_are_not_decoded(kl_engines, monkeypatch):
    """A lossless batch of two requests, the first already past its deadline: it is answered 504
    without a decoder call; the second decodes as usual."""
    here = kl_engines["here"]
    calls = []
    hook = here.vae.decoder.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    try:
        z = latents(here, 6, 6)
        late = here.prepare(DecodeRequest(z.repeat(3, 1, 1, 1), latents_scaled=True), here.context(timeout_s=0.001))
        prompt = here.prepare(DecodeRequest(z.repeat(3, 1, 1, 1), latents_scaled=True), here.context(timeout_s=60))
        time.sleep(0.01)
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


def test_a_tile_call_carries_the_fingerprint_and_the_remaining_time(kl_engines):
    here = kl_engines["here"]
    call = TileCall(here.context(timeout_s=9), here.fingerprint)
    seen = []

    class Recording(Peer):
        def remote(self, tile, part, fingerprint, remaining_s):
            seen.append((fingerprint, remaining_s))
            return super().remote(tile, part, fingerprint, remaining_s)

    spread = spreader_to(Recording(kl_engines["same"]))
    with torch_threads(1):
        list(spread.images([latents(here, 8, 8)], "high", call, None))
    ((fingerprint, remaining),) = seen
    assert fingerprint == here.fingerprint and 0 < remaining <= 9


def test_routing_a_tile_waits_in_slices_and_stops_when_the_caller_leaves():
    """Every replica busy: Serve's routing of a tile waits; the device thread waits for it in
    slices, and a caller that leaves ends the wait within one, not at the deadline."""
    slices = []

    class Unrouted(Response):
        def _to_object_ref_sync(self, _timeout_s=None):
            slices.append(_timeout_s)
            time.sleep(_timeout_s)
            raise TimeoutError

    context = RequestContext.admit(120, Limits())
    threading.Timer(0.3, context.abandon).start()
    start = time.monotonic()
    with pytest.raises(DecodeAbandoned):
        ReplicaTiles.paced(Unrouted(), context)
    assert time.monotonic() - start < 5 and len(slices) > 1 and max(slices) <= WAIT_SLICE_S


async def test_an_image_tile_that_waited_past_its_deadline_on_the_tile_thread_is_not_decoded():
    from concurrent.futures import ThreadPoolExecutor

    from vae_service.serving.tile_spread import run_tile

    decoded = []
    with ThreadPoolExecutor(1) as tile_thread:
        late = sub_decode_context("a" * 16, 0.01, "a" * 16)
        time.sleep(0.02)
        with pytest.raises(DecodeTimeout):
            await run_tile(tile_thread, lambda: decoded.append(1) or torch.zeros(1), late)
        on_time = sub_decode_context("a" * 16, 30.0, "a" * 16)
        assert torch.equal(
            await run_tile(tile_thread, lambda: decoded.append(1) or torch.zeros(1), on_time), torch.zeros(1)
        )
    assert decoded == [1]


async def test_prices_waiting_for_the_pricing_thread_are_bounded_then_429_with_retry_after(kl_dir):
    from vae_service.serving.decode_service import PRICING_QUEUE

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
