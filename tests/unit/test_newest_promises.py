"""Documented promises that no other test turned red when broken (issue 41, item 7), each held here
through public behaviour, on real engines of the tiny test models (a fake only for an injected
fault: a slow decode, a slow encoder, a held device):

1. the per-request FLOP limit (`max_decode_tflop`) counts every item of the request;
2. a `high` batch decodes together only when it fits the memory bound together;
3. encoding counts toward the request's one deadline, never a fresh timeout;
4. a replica takes a tile only while no batch of its own is running or queued;
5. the fingerprint holds the CPU threads a replica really uses when `cpu_threads` is unset, so
   replicas on nodes of other core counts differ;
6. video tiles are offered at the start until two were refused, the rest decoded here.
"""

import asyncio
import os
import re
import threading
import time

import pytest
import torch

from tests.models import torch_threads
from tests.peers import Deployment, Replica, here_only
from vae_service.config import Batching, Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, DecodeTimeout, LimitExceeded
from vae_service.engine.media.encoding import encode_item
from vae_service.engine.planning.tiling import TileGrid
from vae_service.engine.request.context import RequestContext
from vae_service.engine.runtime.tile_jobs import TierTile
from vae_service.serving.decode_service import DecodeService

SPREAD = {"min_output_pixels": 48 * 48}  # `high` requests tiled in small tiles, to share them


def engine_for(folder, name: str, **config) -> DecodeEngine:
    settings = {"model": str(folder), "model_name": name, "device": "cpu", "cpu_threads": 1, **config}
    with torch_threads(torch.get_num_threads()):  # an engine binds the thread that builds it
        return DecodeEngine(ServiceConfig(**settings))


def service_for(folder, name: str, **config) -> DecodeService:
    settings = {"model": str(folder), "model_name": name, "device": "cpu", "cpu_threads": 1, **config}
    return DecodeService(ServiceConfig(**settings, serving={"fit_prices_at_start": False}))


@pytest.fixture(scope="module")
def kl(kl_dir):
    return engine_for(kl_dir, "kl")


@pytest.fixture(scope="module")
def wan(wan_dir):
    return engine_for(wan_dir, "wan")


def latents(engine: DecodeEngine, h: int, w: int, batch: int = 1, frames: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, engine.spec.latent_channels, *([frames] if frames else []), h, w, generator=g)


def context(engine: DecodeEngine, **limits) -> RequestContext:
    return RequestContext.admit(600, Limits(**limits), engine.fingerprint)


# ---- 1. the FLOP limit ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind, frames", [("kl", 0), ("wan", 2)])
def test_the_flop_limit_counts_every_item_of_the_request(kl, wan, kind, frames):
    engine = {"kl": kl, "wan": wan}[kind]

    def request(items: int) -> DecodeRequest:
        return DecodeRequest(latents(engine, 6, 5, batch=items, frames=frames), latents_scaled=True)

    with pytest.raises(LimitExceeded, match="max_decode_tflop") as err:  # what one item costs, as refused
        engine.check(request(1), context(engine, max_decode_tflop=1e-30))
    one = float(re.search(r"about (\S+) TFLOP", err.value.message).group(1))
    limit = 2.5 * one  # two items fit, three do not
    assert engine.check(request(1), context(engine, max_decode_tflop=limit)).items == 1
    assert engine.check(request(2), context(engine, max_decode_tflop=limit)).items == 2
    with pytest.raises(LimitExceeded, match="max_decode_tflop") as err:
        engine.check(request(3), context(engine, max_decode_tflop=limit))
    assert err.value.field == "latents"
    priced = float(re.search(r"about (\S+) TFLOP", err.value.message).group(1))
    assert priced == pytest.approx(3 * one, rel=0.01)  # every item counted


# ---- 2. a `high` batch together only within the bound together -------------------------------------
def test_a_high_batch_decodes_together_only_when_it_fits_the_bound_together(kl):
    zs = [latents(kl, 6, 5, seed=s) for s in (1, 2)]
    with torch_threads(1):
        peak = kl.peak_bytes(kl.prepare(DecodeRequest(zs[0], quality="high", latents_scaled=True)))

    def decoder_calls(bound: int) -> list[int]:
        """The batch sizes the decoder saw decoding both requests as one batch under `bound`."""
        prepared = [
            kl.prepare(DecodeRequest(z, quality="high", latents_scaled=True), context(kl, max_decode_bytes=bound))
            for z in zs
        ]
        assert all(p.tiling is None for p in prepared)  # each fits whole alone
        calls = []
        hook = kl.vae.decoder.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
        try:
            with torch_threads(1):
                results = kl.decode(prepared)
        finally:
            hook.remove()
        assert all(not r.tiled and r.output.shape[0] == 1 for r in results)
        return calls

    assert decoder_calls(2 * peak) == [2]  # they fit together: one call
    assert decoder_calls(peak + peak // 2) == [1, 1]  # each fits, both do not: one call each


# ---- 3. encoding within the request's one deadline -------------------------------------------------
async def test_encoding_counts_toward_the_requests_one_deadline(kl_dir):
    """A decode that takes 40% of request_timeout_s and an encode that would end at 130% of it:
    504 at the deadline. A fresh timeout for the encode would give it the whole timeout again
    (until 140%), and the request would be answered."""
    timeout_s = 3.0
    service = service_for(kl_dir, "kl", batching={"request_timeout_s": timeout_s})
    start, encodes = time.monotonic(), []

    def slow_decode(module, args):  # injected: the decode ends at 40% of the timeout
        time.sleep(max(0.0, start + 0.4 * timeout_s - time.monotonic()))

    def slow_encode(item, fmt, settings, fragments):  # injected: the encode ends at 130%
        encodes.append(time.monotonic())
        time.sleep(max(0.0, start + 1.3 * timeout_s - time.monotonic()))
        return encode_item(item, fmt, settings, fragments)

    service.encoders.encode_item = slow_encode
    hook = service.engine.vae.decoder.register_forward_pre_hook(slow_decode)
    try:
        with pytest.raises(DecodeTimeout) as err:
            await service.decode(DecodeRequest(latents(service.engine, 4, 4), output="png", latents_scaled=True))
        answered = time.monotonic()
    finally:
        hook.remove()
    assert encodes and encodes[0] - start < timeout_s  # it timed out while encoding
    assert err.value.field == "output" and answered - start < 1.3 * timeout_s  # at the deadline


# ---- 4. no tile beside a batch of the replica's own, running or queued ----------------------------
def is_refused(message) -> bool:
    return type(message).__name__ == "OfferRefused"


def is_accepted(message) -> bool:
    return type(message).__name__ == "Accepted"


async def first_answer(service: DecodeService, job, fingerprint: str):
    """The replica's first message about a tile offered to it, then the offer let go."""
    messages = service.tile(job, fingerprint, 30.0, "this replica")
    try:
        return await anext(messages)
    finally:
        await messages.aclose()


async def test_a_replica_with_a_batch_of_its_own_queued_takes_no_tile(kl_dir):
    # a request reaching the idle replica waits up to batch_wait_ms for company: queued, not running
    service = service_for(kl_dir, "kl", batching={"batch_wait_ms": 600_000, "max_batch_size": 8})
    engine = service.engine
    job, fingerprint = TierTile(latents(engine, 8, 8), "high"), engine.fingerprint
    assert is_accepted(await first_answer(service, job, fingerprint))  # idle: taken
    own = asyncio.ensure_future(service.decode(DecodeRequest(latents(engine, 4, 4, seed=1), latents_scaled=True)))
    try:
        for _ in range(3000):
            if service.describe()["queued_items"]:
                break
            await asyncio.sleep(0.01)
        described = service.describe()
        assert described["queued_items"] == 1 and described["running_batches"] == 0
        answer = await first_answer(service, job, fingerprint)
        assert is_refused(answer) and "busy" in answer.reason
        service.apply(LiveConfig(batching=Batching(batch_wait_ms=0, max_batch_size=8)))  # it runs now
        assert (await asyncio.wait_for(own, 60)).output.shape[0] == 1
    finally:
        own.cancel()
    assert is_accepted(await first_answer(service, job, fingerprint))  # idle again: taken


# ---- 5. the fingerprint's CPU threads when cpu_threads is unset ------------------------------------
def test_an_unset_cpu_threads_fingerprints_the_threads_the_replica_uses(kl_dir, monkeypatch):
    def unset_on_a_node_of(cores: int) -> tuple[DecodeEngine, int]:
        """An engine without cpu_threads on a node of `cores` cores, and the torch threads its device
        thread decodes with."""
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        engine = engine_for(kl_dir, "kl", cpu_threads=None)
        monkeypatch.undo()
        used = []

        def device_thread():
            engine.bind_thread()
            used.append(torch.get_num_threads())

        thread = threading.Thread(target=device_thread)
        thread.start()
        thread.join()
        return engine, used[0]

    here, used_here = unset_on_a_node_of(3)
    assert used_here == 3
    same_threads = engine_for(kl_dir, "kl", cpu_threads=used_here)
    assert here.fingerprint == same_threads.fingerprint  # it decodes as the threads it uses
    other, used_there = unset_on_a_node_of(4)
    assert used_there == 4 and other.fingerprint != here.fingerprint  # another core count: other bits
    assert other.decodes_otherwise(here.fingerprint) is not None  # its tiles are refused there


# ---- 6. video tiles: offered until two were refused -----------------------------------------------
class OffersWatched(Deployment):
    """The deployment, `on_offer(count)` told of each offer as it is sent."""

    def __init__(self, replicas, on_offer):
        super().__init__(replicas)
        self.on_offer = on_offer

    def offer(self, job, call):
        remote = super().offer(job, call)
        self.on_offer(self.offers)
        return remote


@pytest.mark.parametrize("one_taken", [False, True], ids=["all refused", "the first taken"])
def test_video_tiles_are_offered_until_two_were_refused_the_rest_decoded_here(wan_dir, one_taken):
    """Each offer is answered before the next: two refusals end the offers (a replica on another
    core count refuses every tile; one that took a tile refuses the next, busy); every tile nobody
    took is decoded here, in lockstep with the taken one: the local plan's bits."""
    here = engine_for(wan_dir, "wan", parallel=SPREAD)
    with torch_threads(1):
        prepared = here_only(
            here.prepare(DecodeRequest(latents(here, 14, 14, frames=2, seed=3), quality="high", latents_scaled=True))
        )
    assert isinstance(prepared.tiling, TileGrid) and prepared.tiling.lockstep and len(prepared.tiling.tiles()) == 4
    odd = Replica("other-cores", engine_for(wan_dir, "wan", cpu_threads=2))
    replicas, release = [odd], threading.Event()
    if one_taken:  # the first offer goes to a free replica, held in its decode until the offers end
        taker = Replica("taker", engine_for(wan_dir, "wan"))
        replicas, run_tile = [taker, odd], taker.service.engine.run_tile

        def held(job, fingerprint):  # injected: the taker's decode waits until the offers ended
            release.wait(60)
            yield from run_tile(job, fingerprint)

        taker.service.engine.run_tile = held
    expected = 3 if one_taken else 2
    deployment = OffersWatched(replicas, lambda count: count >= expected and release.set())
    try:
        with torch_threads(1):
            (shared,) = here.decode([prepared], peers=deployment)
    finally:
        release.set()
    with torch_threads(1):
        (alone,) = here.decode([prepared])
    assert not isinstance(shared, Exception), shared
    assert deployment.offers == expected and odd.took == []
    assert shared.timing.replicas == (2 if one_taken else 1) and torch.equal(shared.output, alone.output)
