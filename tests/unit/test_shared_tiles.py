"""One tile mechanism shared with the deployment's replicas (engine/execution/tile_executor.py's SharedTiles,
serving/decode_service.py's `tile`): replicas are real DecodeServices of the same model on threads
of their own (tests/peers.py), only the transport between them stands in for Serve's.

- bits: whatever replicas decode, the answer is the one this engine's own plan gives (`high`
  images and video, `lossless` above the bound by the class's own tiled decode);
- safety: a replica takes one tile at a time, only with its device idle and within its own bound;
  a busy deployment decodes as if nothing were shared (an optional grid: whole);
- skew: a replica that would decode other bits refuses, and its tiles are decoded here;
- faults: a lost tile is decoded once more, lost twice answers 503, a replica's bug 500, for the
  request alone (the batch and the batcher never run it again); a short stream is resent from
  the chunk it reached; a hung replica ends at the request's deadline, a caller that leaves frees
  the device thread within a slice and the replicas' slots;
- the out-of-memory retry goes through the same executor; streams are bounded both ways.
"""

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import torch

from tests import zoo
from tests.models import build_full_vae, save_vae, torch_threads
from tests.peers import Deployment, Fault, Replica, here_only
from vae_service.config import Limits, LiveConfig, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.execution import tile_executor
from vae_service.engine.execution.peer_contract import Accepted, Chunk, End, TileBug
from vae_service.engine.planning.planner import ClassTiles
from vae_service.engine.planning.tiling import TileGrid
from vae_service.engine.request.context import WAIT_SLICE_S
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout, Unavailable
from vae_service.engine.runtime.tile_jobs import TierTile

SPREAD = {"min_output_pixels": 48 * 48}  # tiles of 8 latent pixels (64x64 output pixels) and more


def engine_for(folder, name: str, **config) -> DecodeEngine:
    settings = {"model": str(folder), "model_name": name, "device": "cpu", "cpu_threads": 1, **config}
    return DecodeEngine(ServiceConfig(**settings))


@pytest.fixture(scope="module")
def folders(kl_dir, flux_dir, wan_dir, tmp_path_factory):
    found = {"kl": kl_dir, "flux": flux_dir, "wan": wan_dir}
    for name in ("wan2.2", "qwen-image", "hunyuan-video"):
        found[name] = save_vae(zoo.build(zoo.BY_NAME[name]), tmp_path_factory.mktemp(name))
    found["kl-other"] = save_vae(build_full_vae("kl", seed=7), tmp_path_factory.mktemp("kl-other"))
    return found


class Models:
    """Per kind: the requesting engine and two replicas of the same model, built when first asked."""

    def __init__(self, folders):
        self.folders, self.built = folders, {}

    def __getitem__(self, kind: str) -> tuple[DecodeEngine, list[Replica]]:
        if kind not in self.built:
            folder = self.folders[kind]
            here = engine_for(folder, kind, parallel=SPREAD)
            replicas = [Replica(f"{kind}-{i}", engine_for(folder, kind, parallel=SPREAD)) for i in range(2)]
            self.built[kind] = (here, replicas)
        return self.built[kind]


@pytest.fixture(scope="module")
def models(folders):
    return Models(folders)


def latents(engine: DecodeEngine, h: int, w: int, batch: int = 1, frames: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, engine.spec.latent_channels, *([frames] if frames else []), h, w, generator=g)


def decode(engine: DecodeEngine, prepared, peers=None):
    with torch_threads(1):
        return engine.decode([prepared], peers=peers)[0]


def shared_and_here(engine: DecodeEngine, replicas: list[Replica], prepared):
    deployment = Deployment(replicas)
    shared = decode(engine, prepared, deployment)
    alone = decode(engine, here_only(prepared))
    return shared, alone, deployment


# ---- bits ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, h, w, frames, batch, output",
    [
        ("kl", 13, 21, 0, 1, "uint8"),
        ("kl", 17, 9, 0, 2, "float"),
        ("flux", 24, 24, 0, 1, "float"),
        ("wan", 20, 18, 3, 1, "float"),
        ("wan", 13, 17, 2, 2, "uint8"),
        ("wan2.2", 9, 14, 2, 1, "float"),
        ("qwen-image", 9, 30, 1, 2, "uint8"),
    ],
)
def test_high_tiles_shared_with_replicas_are_the_local_plan_bit_for_bit(models, kind, h, w, frames, batch, output):
    here, replicas = models[kind]
    z = latents(here, h, w, batch, frames, seed=h * w + frames)
    with torch_threads(1):
        prepared = here.prepare(DecodeRequest(z, quality="high", output=output, latents_scaled=True))
    assert isinstance(prepared.tiling, TileGrid) and len(prepared.tiling.tiles()) >= 2
    shared, alone, _ = shared_and_here(here, replicas, prepared)
    assert shared.tiled and alone.tiled and alone.timing.replicas == 1
    assert shared.timing.replicas >= 2 and torch.equal(shared.output, alone.output)
    if here.video:  # streamed: chunk by chunk, each once every tile's part of it arrived
        chunks = []
        with torch_threads(1):
            (streamed,) = here.decode([replace(prepared, sink=chunks.append)], peers=Deployment(replicas))
        frame_axis = 1 if alone.output.dtype == torch.uint8 else 2
        assert streamed.output is None and len(chunks) == frames
        assert torch.equal(torch.cat([c.pixels for c in chunks], frame_axis), alone.output)


@pytest.mark.parametrize(
    "kind, h, w, frames, batch",
    [
        ("kl", 24, 20, 0, 1),
        ("kl", 17, 31, 0, 2),
        ("flux", 9, 40, 0, 1),
        ("hunyuan-video", 34, 20, 2, 1),
        ("wan", 33, 20, 1, 1),  # 2 of its 32-latent-px tiles
        ("wan2.2", 23, 14, 1, 1),
        ("qwen-image", 36, 20, 1, 1),
    ],
)
def test_lossless_above_the_bound_shared_is_the_classs_tiled_decode_bit_for_bit(models, kind, h, w, frames, batch):
    """The class's own tiled decode, its decoder's tiles taken by replicas: the same bits as decoding
    it here (itself bit-identical to `vae.enable_tiling(); vae.decode`, test_tiling)."""
    here, replicas = models[kind]
    request = DecodeRequest(latents(here, h, w, batch, frames, seed=h * w), latents_scaled=True)
    with torch_threads(1):  # the plan a bound under its whole decode makes (unpriced here: test_tiling prices it)
        prepared = replace(here.check(request), tiling=ClassTiles())
    assert isinstance(prepared.tiling, ClassTiles)
    shared, alone, _ = shared_and_here(here, replicas, prepared)
    assert shared.tiled and alone.tiled and shared.timing.replicas >= 2 and alone.timing.replicas == 1
    assert torch.equal(shared.output, alone.output)


@pytest.mark.parametrize("kind, h, w, frames", [("kl", 24, 20, 0), ("wan", 33, 20, 1)])
def test_a_class_tiled_decode_is_shared_only_where_the_bound_holds_what_sharing_holds_here(models, kind, h, w, frames):
    """Sharing the class's tiled decode holds here the outputs replicas finished ahead of the blend:
    under a bound that holds the local decode but not that, every decoder call stays here (no
    offer) with the same bits; under one that holds both, replicas take tiles."""
    here, replicas = models[kind]
    request = DecodeRequest(latents(here, h, w, 1, frames, seed=3), latents_scaled=True)
    with torch_threads(1):
        prepared = replace(here.check(request), tiling=ClassTiles())
    local, shared_price = here.cost.class_tiled_peak(prepared), here.cost.class_tiled_peak(prepared, shared=True)
    assert local < shared_price
    alone = decode(here, here_only(prepared))
    for bound, offered in ((local, False), (shared_price, True)):
        here.limits = Limits(max_decode_bytes=bound)  # the bound the request is admitted under
        try:
            with torch_threads(1):
                bounded = replace(here.check(request), tiling=ClassTiles())
            deployment = Deployment(replicas)
            answer = decode(here, bounded, deployment)
        finally:
            here.limits = Limits()
        assert (deployment.offers > 0) is offered and torch.equal(answer.output, alone.output)


# ---- which replica takes a tile -------------------------------------------------------------------
def offer(replica: Replica, job, fingerprint: str, remaining_s: float = 30.0) -> list:
    """The first message of `replica`'s answer to a tile, then the stream closed."""

    async def first():
        messages = replica.service.tile(job, fingerprint, remaining_s, replica.name)
        try:
            return [await anext(messages)]
        finally:
            await messages.aclose()

    return replica.call(first())


def hold(replica: Replica):
    """A request of the replica's own, held on its device until the returned event is set."""
    inside, release = threading.Event(), threading.Event()

    def held(module, args):
        inside.set()
        release.wait(60)

    hook = replica.service.engine.vae.decoder.register_forward_pre_hook(held)
    engine = replica.service.engine
    pending = replica.decode(DecodeRequest(latents(engine, 4, 4), latents_scaled=True))
    assert inside.wait(30)
    return release, hook, pending


def test_a_replica_takes_one_tile_at_a_time_only_while_its_device_is_idle_within_its_bound(models):
    here, (replica, _) = models["kl"]
    job, fingerprint = TierTile(latents(here, 8, 8), "high"), here.fingerprint
    assert isinstance(offer(replica, job, fingerprint)[0], Accepted)  # idle: taken (then let go)
    assert "decodes as" in offer(replica, job, "0" * 16)[0].reason  # another fingerprint
    assert "deadline" in offer(replica, job, fingerprint, remaining_s=0.0)[0].reason
    replica.service.apply(LiveConfig(limits=Limits(max_decode_bytes=2**20)))
    try:
        assert "over this replica's max_decode_bytes" in offer(replica, job, fingerprint)[0].reason
    finally:
        replica.service.apply(LiveConfig())
    release, hook, pending = hold(replica)  # its own request on its device
    try:
        assert "busy" in offer(replica, job, fingerprint)[0].reason
    finally:
        release.set()
        hook.remove()
    pending.result(30)

    async def two_at_once():
        first = replica.service.tile(job, fingerprint, 30.0, replica.name)
        second = replica.service.tile(job, fingerprint, 30.0, replica.name)
        try:
            return await anext(first), await anext(second), [m async for m in first]
        finally:
            await second.aclose()

    taken, refused, rest = replica.call(two_at_once())
    assert isinstance(taken, Accepted) and "busy" in refused.reason  # one tile of any request at a time
    assert isinstance(rest[0], Chunk) and rest[-1] == End(1)
    with torch_threads(1):
        assert torch.equal(rest[0].pixels, next(here.run_tile(job, fingerprint)))  # the same bits anywhere


def test_an_offer_carries_the_requests_fingerprint_and_the_time_left(models):
    here, replicas = models["kl"]
    context = here.context(timeout_s=9)
    with torch_threads(1):
        prepared = here.prepare(DecodeRequest(latents(here, 17, 13), quality="high", latents_scaled=True), context)
    deployment = Deployment(replicas)
    decode(here, prepared, deployment)
    assert deployment.sent and all(f == here.fingerprint and 0 < left <= 9 for f, left in deployment.sent)


@pytest.mark.parametrize("ahead", [0, 2, 5])
def test_no_more_finished_tiles_wait_for_the_blend_than_the_plan_left_room_for(models, monkeypatch, ahead):
    """`TileGrid.ahead`: what the bound left beside one tile's decode (engine/planning/tiling.py's tile_for);
    none: the tiles stay here, one at a time. Watched when nothing decodes here: the blend's next
    output may be among those waiting, in place of the tile this device would be decoding."""
    here, replicas = models["kl"]
    seen = []  # at each step of the blend: (finished outputs waiting, furthest job out or held - the blend's)
    next_here = tile_executor._Outputs._next_here

    def watched(outputs):
        waiting = [*outputs.held, *outputs.out]
        seen.append((len(outputs.held), max(waiting, default=outputs.nxt) - outputs.nxt))
        return next_here(outputs)

    monkeypatch.setattr(tile_executor._Outputs, "_next_here", watched)
    z = latents(here, 24, 20, seed=ahead)
    with torch_threads(1):
        prepared = here.prepare(DecodeRequest(z, quality="high", latents_scaled=True))
    prepared = replace(prepared, tiling=TileGrid(8, 24, 20, ahead=ahead))
    shared, alone, deployment = shared_and_here(here, replicas, prepared)
    assert torch.equal(shared.output, alone.output) and len(prepared.tiling.tiles()) == 12
    if ahead == 0:
        assert deployment.offers == 0 and shared.timing.replicas == 1 and not seen
        return
    assert shared.timing.replicas >= 2 and seen
    assert max(held for held, _ in seen) <= ahead + 1 and max(furthest for _, furthest in seen) <= ahead


def test_a_taken_tile_stops_at_the_requests_deadline(models, monkeypatch):
    here, (replica, _) = models["wan"]
    engine, decoded = replica.service.engine, []
    run_tile = engine.run_tile

    def slow(job, fingerprint):  # injected: each latent frame of the tile takes 0.15 s
        for chunk in run_tile(job, fingerprint):
            decoded.append(1)
            time.sleep(0.15)
            yield chunk

    monkeypatch.setattr(engine, "run_tile", slow)
    with torch_threads(1):
        prepared = here.prepare(DecodeRequest(latents(here, 8, 8, frames=8), quality="high", latents_scaled=True))
    job = TierTile(here.runtime.scaling.to_decoder_input(prepared, here.device), "high")

    async def read_all():
        return [m async for m in replica.service.tile(job, here.fingerprint, 0.4, replica.name)]

    messages = replica.call(read_all())
    assert isinstance(messages[0], Accepted) and not isinstance(messages[-1], End)  # stopped, not finished
    assert len(decoded) < 8 and not replica.service.tiles.taken


def test_busy_replicas_take_no_tile_a_tiled_request_decodes_here_and_an_optional_grid_whole(models, kl_dir):
    here, replicas = models["kl"]
    untiled = engine_for(kl_dir, "kl")
    held = [hold(r) for r in replicas]
    try:
        with torch_threads(1):
            over = here.prepare(DecodeRequest(latents(here, 17, 13, seed=2), quality="high", latents_scaled=True))
        deployment = Deployment(replicas)
        optional = decode(here, over, deployment)
        forced = decode(here, here_only(over), deployment)
    finally:
        for release, hook, _ in held:
            release.set()
            hook.remove()
    for _, _, pending in held:
        pending.result(30)
    # each offer answered busy at once; the optional grid asked once, the 6 tiles at most 3 times
    # (after 0, 1 and 2 more tiles decoded here: a busy deployment is asked less and less; fewer
    # where this device finished the tiles before a refusal came back)
    assert 1 + 1 <= deployment.offers <= 1 + 3
    assert not optional.tiled and optional.timing.replicas == 1  # fits whole, nobody to share with
    assert (
        forced.tiled
        and forced.timing.replicas == 1
        and torch.equal(forced.output, decode(here, here_only(over)).output)
    )
    with torch_threads(1):
        whole = untiled.decode(
            [untiled.prepare(DecodeRequest(over.request.latents, quality="high", latents_scaled=True))]
        )
    assert torch.equal(optional.output, whole[0].output)  # as if parallel.min_output_pixels were not set


def test_min_output_pixels_has_no_effect_where_nothing_is_shared(models, kl_dir):
    here, _ = models["kl"]
    plain = engine_for(kl_dir, "kl")
    z = latents(here, 17, 13, seed=4)
    with torch_threads(1):
        (spread_engine,) = here.decode([here.prepare(DecodeRequest(z, quality="high", latents_scaled=True))])
        (no_setting,) = plain.decode([plain.prepare(DecodeRequest(z, quality="high", latents_scaled=True))])
    assert not spread_engine.tiled and torch.equal(spread_engine.output, no_setting.output)


@pytest.fixture(scope="module")
def skewed(folders):
    kl = folders["kl"]
    return {
        "other weights": engine_for(folders["kl-other"], "kl"),
        "other precision": engine_for(kl, "kl", decode_precision="bf16"),
        "other thread count": engine_for(kl, "kl", cpu_threads=2),
        "other fast path": engine_for(kl, "kl", fast_path={"disable": ["upsample_fold"]}),
    }


@pytest.mark.parametrize("other", ["other weights", "other precision", "other thread count", "other fast path"])
def test_a_replica_that_would_decode_other_bits_refuses_its_tiles_and_they_are_decoded_here(models, skewed, other):
    here, _ = models["kl"]
    odd = Replica("odd", skewed[other])
    assert skewed[other].fingerprint != here.fingerprint
    with torch_threads(1):
        prepared = here.prepare(DecodeRequest(latents(here, 17, 13, seed=3), quality="high", latents_scaled=True))
    shared, alone, deployment = shared_and_here(here, [odd], here_only(prepared))
    assert deployment.offers >= 1 and odd.took == []
    assert shared.timing.replicas == 1 and torch.equal(shared.output, alone.output)  # never blended


def test_video_tiles_of_a_skewed_replica_are_streamed_from_here(models, wan_dir):
    here, _ = models["wan"]
    odd = Replica("odd", engine_for(wan_dir, "wan", cpu_threads=2))
    with torch_threads(1):
        prepared = here.prepare(
            DecodeRequest(latents(here, 14, 11, frames=3, seed=4), quality="high", latents_scaled=True)
        )
    shared, alone, _ = shared_and_here(here, [odd], here_only(prepared))
    assert shared.timing.replicas == 1 and odd.took == [] and torch.equal(shared.output, alone.output)


# ---- faults ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, die_after", [("kl", 1), ("wan", 2), ("wan", 3)])
def test_a_lost_tile_is_decoded_once_more_and_a_short_stream_resent_from_the_chunk_it_reached(models, kind, die_after):
    """Dies after Accepted (and 1 or 2 of a video tile's chunks): the tile again, the same bits."""
    here, replicas = models[kind]
    replicas[0].fault = Fault(die_after=die_after)
    try:
        frames = 3 if here.video else 0
        z = latents(here, 14, 11, frames=frames, seed=5)
        with torch_threads(1):
            prepared = here.prepare(DecodeRequest(z, quality="high", latents_scaled=True))
        shared, alone, deployment = shared_and_here(here, replicas, prepared)
    finally:
        replicas[0].fault = None
    assert not isinstance(shared, Exception), shared
    assert torch.equal(shared.output, alone.output) and deployment.offers >= 2


@pytest.mark.parametrize("kind, frames, optional", [("kl", 0, True), ("wan", 2, False), ("wan", 2, True)])
def test_a_tile_lost_before_its_offer_is_answered_is_a_loss_of_the_request_alone(models, kind, frames, optional):
    """Replicas that die before they answer the offer (video tiles' first offers, an optional grid's
    first offer): each such tile is lost once and decoded here, so the request answers the bits it
    would alone (tiled here, or whole where an optional grid found nobody), never failing the batch."""
    here, replicas = models[kind]
    z = latents(here, 24, 24, frames=frames, seed=9)
    with torch_threads(1):
        prepared = here.prepare(DecodeRequest(z, quality="high", latents_scaled=True))
    if not optional:
        prepared = here_only(prepared)
    for times in (1, 10):  # one replica's first offer lost, or every offer to any replica
        for replica in replicas:
            replica.fault = Fault(die_after=0, times=times)
        try:
            answer = decode(here, prepared, Deployment(replicas))
        finally:
            for replica in replicas:
                replica.fault = None
        assert not isinstance(answer, Exception), answer
        reference = decode(here, here_only(prepared)) if answer.tiled else decode(here, prepared)
        assert torch.equal(answer.output, reference.output) and reference.tiled == answer.tiled


def test_a_tile_lost_twice_answers_503_and_a_replicas_bug_500_for_the_request_alone(models):
    here, replicas = models["kl"]
    z = latents(here, 17, 13, seed=6)
    with torch_threads(1):
        prepared = here_only(here.prepare(DecodeRequest(z, quality="high", latents_scaled=True)))
    for replica in replicas:
        replica.fault = Fault(die_after=1, times=10)
    try:
        deployment = Deployment(replicas, retry_after_s=3.0)
        lost = decode(here, prepared, deployment)
    finally:
        for replica in replicas:
            replica.fault = None
    from vae_service.protocol.errors import wire_error

    assert isinstance(lost, Unavailable) and wire_error(lost).http_status == 503 and lost.retry_after_s == 3.0
    replicas[1].fault = Fault(bug=True)
    try:
        bug = decode(here, prepared, Deployment([replicas[1]]))
    finally:
        replicas[1].fault = None
    assert isinstance(bug, TileBug) and "a bug in the replica" not in str(bug)  # logged, never answered


async def test_the_batcher_does_not_run_a_request_again_for_a_tile_failure(models, kl_dir, monkeypatch):
    """Timing-free: every offer is lost, however long its answer takes. The replicas die before
    they answer (a replica that took a tile and died would still be freeing its slot when the
    tile is offered again, refuse it busy, and it would be decoded here), and an offer waits for
    its answer as long as the request does (no replica's answer is late for it)."""
    here, replicas = models["kl"]
    monkeypatch.setattr(tile_executor, "OFFER_WAIT_S", 3600.0)
    for replica in replicas:
        replica.fault = Fault(die_after=0, times=10)
    config = ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1, serving={"fit_prices_at_start": False})
    from vae_service.serving.decode_service import DecodeService

    service = DecodeService(config, here, peers=Deployment(replicas))
    runs = []
    decode_batch = service.scheduler.run_batch

    def counted(batch, abandoned, turn):
        runs.append(len(batch))
        return decode_batch(batch, abandoned, turn)

    service.scheduler.run_batch = counted
    try:
        prepared = []
        for seed in (7, 8):  # two requests of one batch key
            request = DecodeRequest(latents(here, 17, 13, seed=seed), quality="high", latents_scaled=True)
            prepared.append(here_only(await asyncio.to_thread(here.prepare, request, service.admit())))
        answers = await asyncio.gather(*map(service._decode_prepared, prepared), return_exceptions=True)
    finally:
        for replica in replicas:
            replica.fault = None
        await service.scheduler.close()
    assert all(isinstance(a, Unavailable) for a in answers)  # each lost a tile twice: 503, each alone
    assert runs == [2]  # one run of their batch; never again request by request


def test_a_replica_that_hangs_with_a_tile_ends_the_request_at_its_deadline_with_504(models):
    here, replicas = models["kl"]
    replicas[0].fault = Fault(hang_after=1, times=10)  # takes the tile, then never sends it
    try:
        context = here.context(timeout_s=3.0)
        with torch_threads(1):
            prepared = here_only(
                here.prepare(DecodeRequest(latents(here, 17, 13), quality="high", latents_scaled=True), context)
            )
        result = decode(here, prepared, Deployment([replicas[0]]))
    finally:
        replicas[0].fault = None
    assert isinstance(result, DecodeTimeout) and not isinstance(result, DecodeAbandoned)  # 504, not a 503
    # the deadline that ended it is the request's own (request_timeout_s, passed when it answered),
    # not a shorter wait of the tile's or the offer's
    assert context.expired and "within request_timeout_s" in result.message


def test_a_caller_that_leaves_while_tiles_are_out_frees_the_device_thread_and_the_replicas(models):
    here, replicas = models["kl"]
    context = here.context(timeout_s=120)
    with torch_threads(1):
        prepared = here_only(
            here.prepare(DecodeRequest(latents(here, 24, 24), quality="high", latents_scaled=True), context)
        )
    inside = threading.Event()

    def slow(module, args):  # the replica's tile decodes for a long time
        inside.set()
        time.sleep(WAIT_SLICE_S)

    hooks = [r.service.engine.vae.decoder.register_forward_pre_hook(slow) for r in replicas]
    out, done = [], threading.Event()

    def run():
        out.append(decode(here, prepared, Deployment(replicas)))
        done.set()

    try:
        threading.Thread(target=run, daemon=True).start()
        assert inside.wait(30)
        context.abandon()
        assert done.wait(20 * WAIT_SLICE_S + 10)  # within slices and one tile here, not 120 s
    finally:
        for hook in hooks:
            hook.remove()
    assert isinstance(out[0], DecodeAbandoned)
    deadline = time.monotonic() + 10
    while any(r.service.tiles.taken for r in replicas) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(r.service.tiles.taken for r in replicas)  # their tiles were cancelled, slots freed


def test_an_offer_the_request_stops_waiting_for_is_cancelled_before_a_replica_takes_it(models):
    """A request that ends while its offer is still unanswered (here the caller leaves; a deadline
    or a replica's bug alike) cancels the offer: the replica it reaches late never takes the tile,
    never holds its one tile slot nor decodes for a request that is gone."""
    here, replicas = models["kl"]
    replica = replicas[0]
    context = here.context(timeout_s=120)
    with torch_threads(1):  # an optional grid: its first offer is waited for before the others
        prepared = here.prepare(
            DecodeRequest(latents(here, 24, 24, seed=9), quality="high", latents_scaled=True), context
        )
    deployment, took = Deployment([replica]), len(replica.took)
    replica.fault = Fault(late_s=0.8 * tile_executor.OFFER_WAIT_S, times=10)  # after the caller left
    out, done = [], threading.Event()

    def run():
        out.append(decode(here, prepared, deployment))
        done.set()

    try:
        threading.Thread(target=run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not deployment.offers and time.monotonic() < deadline:
            time.sleep(0.001)
        context.abandon()
        assert done.wait(30)
        while replica.ongoing and time.monotonic() < deadline:  # the offer's stream ends on the replica
            time.sleep(0.01)
    finally:
        replica.fault = None
    assert isinstance(out[0], DecodeAbandoned) and deployment.offers == 1
    assert replica.ongoing == 0 and len(replica.took) == took and not replica.service.tiles.taken


def test_an_offer_no_replica_answers_in_time_is_decoded_here(models):
    here, replicas = models["kl"]
    replicas[0].fault = Fault(hang_after=0, times=10)  # Serve still routing it, say
    try:
        with torch_threads(1):
            request = DecodeRequest(latents(here, 17, 13, seed=8), quality="high", latents_scaled=True)
            prepared = here_only(here.prepare(request))
        shared, alone, _ = shared_and_here(here, [replicas[0]], prepared)
    finally:
        replicas[0].fault = None
    assert shared.timing.replicas == 1 and torch.equal(shared.output, alone.output)


def test_the_out_of_memory_retry_shares_its_tiles_through_the_same_executor(models):
    here, replicas = models["kl"]
    z = latents(here, 16, 16, seed=9)
    calls = []

    def out_of_memory_once(module, args):
        calls.append(args[0].shape)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    hook = here.vae.decoder.register_forward_pre_hook(out_of_memory_once)
    try:
        with torch_threads(1):
            prepared = replace(here.prepare(DecodeRequest(z, quality="high", latents_scaled=True)), tiling=None)
        deployment = Deployment(replicas)
        result = decode(here, prepared, deployment)
    finally:
        hook.remove()
    assert result.tiled and result.timing.replicas >= 2 and deployment.offers >= 1


# ---- bounded streams ------------------------------------------------------------------------------
def test_a_taken_video_tile_decodes_only_a_few_chunks_ahead_of_what_was_sent(models, monkeypatch):
    from vae_service.serving.scheduling.tile_surface import TILE_CHUNKS_AHEAD

    here, (replica, _) = models["wan"]
    frames, calls, engine = 6, [], replica.service.engine
    run_tile = engine.run_tile

    def counted(job, fingerprint):
        for chunk in run_tile(job, fingerprint):
            calls.append(1)  # decoded
            yield chunk

    monkeypatch.setattr(engine, "run_tile", counted)
    with torch_threads(1):
        request = DecodeRequest(latents(here, 8, 8, frames=frames), quality="high", latents_scaled=True)
        job = TierTile(here.runtime.scaling.to_decoder_input(here.prepare(request), here.device), "high")

    async def read_slowly():
        messages = replica.service.tile(job, here.fingerprint, 60.0, replica.name)
        try:
            assert isinstance(await anext(messages), Accepted)
            await asyncio.sleep(1.0)  # the decode runs ahead while nobody reads
            decoded_unread = len(calls)
            rest = [m async for m in messages]
            return decoded_unread, rest
        finally:
            await messages.aclose()

    decoded_unread, rest = replica.call(read_slowly())
    # the ones queued, and one decoded waiting for room; never the whole tile
    assert 0 < decoded_unread <= TILE_CHUNKS_AHEAD + 1 < frames
    assert len(rest) == frames + 1 and rest[-1] == End(frames)


async def test_a_frame_stream_holds_a_few_chunks_its_reader_has_not_taken():
    from vae_service.engine.execution.video import FrameChunk
    from vae_service.engine.request.context import RequestContext
    from vae_service.serving.outputs.frame_stream import CHUNKS_AHEAD, FrameStream

    context = RequestContext.admit(60, Limits())
    stream = FrameStream(1, context)
    handed = []

    def device():
        try:
            for k in range(CHUNKS_AHEAD + 3):
                stream.sink(FrameChunk(0, k, torch.zeros(1, 1, 2, 2, 3, dtype=torch.uint8)))
                handed.append(k)
        except DecodeAbandoned:
            handed.append("stopped")

    thread = threading.Thread(target=device, daemon=True)
    thread.start()
    await asyncio.sleep(0.5)
    assert len(handed) == CHUNKS_AHEAD  # the device waits for the reader
    context.abandon()  # the reader left: the wait ends within a slice
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive() and handed[CHUNKS_AHEAD:] == ["stopped"]
