"""Work that grows with a request runs under its context (issue 41): a per-shape price on the meta
twin, or a frame count traced for it, checks the request before each of the twin's module
forwards and stops within one slice and one decoder call of its deadline or its abandonment (a
price nobody waits for no longer holds the pricing thread for seconds); per-shape prices are kept
by the class's tile grid, so shapes a few pixels apart do not pay again.

The model: tiny-hunyuan-video, a class that tiles in time past 4 latent frames, priced per shape on
the twin (as a class without a tile formula is): 20 latent frames at 62x60 take seconds to price."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.pricing.class_tiled_price import PerShapeClassTiled, class_tiled_codec
from vae_service.engine.pricing.memory import TwinRun
from vae_service.engine.request.context import WAIT_SLICE_S, RequestContext
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout
from vae_service.models.class_tiling import AxisTiles, ClassGrid
from vae_service.models.probe_cache import ProbeCache

ENDS_AFTER_S = 0.4  # into a price that takes seconds


@pytest.fixture(scope="module")
def engine():
    probes = ProbeCache()  # fresh: the twin runs these tests count are not answered from elsewhere
    engine = DecodeEngine(ServiceConfig(model="tiny-hunyuan-video", device="cpu", cpu_threads=1), probes=probes)
    # its class tiled decode priced per shape (its fit skipped: seconds), as a process that read that
    # answer from the probe store would have it
    kept = {"per_shape": "no tile formula", "by_grid": True}
    probes.get(engine.cost.architecture, "class tiled", lambda: class_tiled_codec(*twin_of(engine)).decode(kept))
    assert isinstance(engine.cost.class_tiled, PerShapeClassTiled)
    return engine


def twin_of(engine):
    """(the twin with the class's tiling on, the run of its tiled decode, the spec)."""
    return engine.cost._fit_class_tiled.args


@pytest.fixture
def twin_runs(monkeypatch):
    """The shapes the twin decodes (h, w, latent frames)."""
    runs = []
    original = TwinRun.run

    def counted(self, items, h, w, frames=None):
        runs.append((h, w, frames))
        return original(self, items, h, w, frames)

    monkeypatch.setattr(TwinRun, "run", counted)
    return runs


def checked(engine, t: int, h: int, w: int, context: RequestContext):
    z = torch.zeros(1, engine.spec.latent_channels, t, h, w)
    return engine.check(DecodeRequest(z, tiling="model", latents_scaled=True), context)


def priced_on_a_thread(engine, prepared) -> tuple[object, float]:
    """engine.price on a thread of its own, as the service's pricing thread runs it: what it answered
    or raised, and when (time.monotonic) it did so, read on that thread."""

    def price():
        try:
            answer = engine.price(prepared)
        except Exception as error:
            answer = error
        return answer, time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(price).result()


@pytest.fixture
def decoder_calls(engine):
    """How long each of the twin's decoder calls took (s)."""
    decoder = twin_of(engine)[1].twin.decoder
    started, took = [], []
    handles = [
        decoder.register_forward_pre_hook(lambda *_: started.append(time.monotonic())),
        decoder.register_forward_hook(lambda *_: took.append(time.monotonic() - started[-1])),
    ]
    yield took
    for handle in handles:
        handle.remove()


def test_a_price_past_its_deadline_stops_within_a_slice_and_a_decoder_call(engine, twin_runs, decoder_calls):
    """The issue's request: 20 latent frames at 62x60 with `tiling: "model"`, seconds of twin work;
    its deadline passes early in it. The price raises the decode's DecodeTimeout, on its own
    thread, within WAIT_SLICE_S and one decoder call of the deadline, and keeps nothing."""
    context = RequestContext.admit(ENDS_AFTER_S, engine.limits, engine.fingerprint)
    prepared = checked(engine, 20, 62, 60, context)
    assert engine.needs_shape_work(prepared)
    answer, at = priced_on_a_thread(engine, prepared)
    late = at - context.deadline
    assert isinstance(answer, DecodeTimeout) and not isinstance(answer, DecodeAbandoned), answer
    assert twin_runs and decoder_calls  # it was running the twin when the deadline came
    assert 0 <= late <= WAIT_SLICE_S + max(decoder_calls), (late, max(decoder_calls))
    assert engine.needs_shape_work(prepared)  # a stopped price is not kept


def test_a_price_whose_caller_left_stops_within_a_slice_and_a_decoder_call(engine, twin_runs, decoder_calls):
    """The same request without a deadline, whose caller leaves early in its price (a client that
    disconnected): DecodeAbandoned within WAIT_SLICE_S and one decoder call of leaving."""
    context = RequestContext.unbounded(engine.limits, engine.fingerprint)
    prepared = checked(engine, 20, 62, 60, context)
    left_at = []

    def leave():
        left_at.append(time.monotonic())
        context.abandon()

    timer = threading.Timer(ENDS_AFTER_S, leave)
    timer.start()
    answer, at = priced_on_a_thread(engine, prepared)
    timer.join()
    assert isinstance(answer, DecodeAbandoned), answer
    assert twin_runs and decoder_calls
    late = at - left_at[0]
    assert 0 <= late <= WAIT_SLICE_S + max(decoder_calls), (late, max(decoder_calls))
    assert engine.needs_shape_work(prepared)


def test_a_frame_count_traced_for_a_request_stops_with_it_and_is_not_refused_for_it(engine, monkeypatch):
    """A decoder without a frame law traces a new count on its twin for the request that asks: a
    caller that leaves meanwhile gets DecodeAbandoned (not a 413 saying the model cannot decode that
    count), and the count is not remembered."""
    counts = engine.spec.geometry.frames
    monkeypatch.setattr(counts, "traced", {t: counts(t) for t in (1, 2, 3)})
    monkeypatch.setattr(counts, "rule", None)  # no law: 9 latent frames are traced when asked
    context, trace = RequestContext.unbounded(engine.limits, engine.fingerprint), counts._trace

    def leaving(latent_frames: int) -> int:  # the caller leaves as the trace begins
        context.abandon()
        return trace(latent_frames)

    monkeypatch.setattr(counts, "_trace", leaving)
    z = torch.zeros(1, engine.spec.latent_channels, 9, 8, 8)
    prepared = engine.check(DecodeRequest(z, latents_scaled=True), context)
    assert engine.needs_shape_work(prepared)
    answer, _ = priced_on_a_thread(engine, prepared)
    assert isinstance(answer, DecodeAbandoned), answer
    assert 9 not in counts.traced


def test_shapes_in_one_tile_grid_share_one_price_and_other_grids_pay(engine, twin_runs):
    """HunyuanVideo's grid: tiles of 32 latent pixels every 24 (an overlap of 8). 39x35 and 40x40 are
    both two tiles a side, within one overlap: one run on the twin, at 40x40, a price at least the
    smaller shape's own; 40x56 has three tiles across: it pays."""
    price, unbounded = engine.cost.class_tiled, RequestContext.unbounded(engine.limits, engine.fingerprint)
    first = engine.price(checked(engine, 2, 39, 35, unbounded))
    assert first.tiling is not None and twin_runs == [(40, 40, 2)]
    second = checked(engine, 2, 40, 40, unbounded)
    assert not engine.needs_shape_work(second)
    engine.price(second)
    assert twin_runs == [(40, 40, 2)]
    other = checked(engine, 2, 40, 56, unbounded)
    assert engine.needs_shape_work(other)
    engine.price(other)
    assert twin_runs == [(40, 40, 2), (40, 56, 2)]
    own = twin_of(engine)[1].run(1, 39, 35, 2)[0]  # what 39x35 alone holds
    assert own <= price.working(39, 35, 2) <= 1.1 * own


@pytest.mark.parametrize("tile, stride", [(32, 24), (64, 48), (16, 16), (12, 4)])
def test_a_shape_is_priced_at_one_of_its_grid_with_no_tile_smaller(tile, stride):
    """`priced_at` keeps the grid (untiled stays untiled, as many tiles per side), makes no tile
    smaller, and lands on a multiple of the overlap (or the grid's last size): few prices per grid."""
    axis = AxisTiles(tile, stride)
    grid = ClassGrid(axis, axis)
    for h in range(1, 4 * tile):
        for w in (1, tile // 2, tile, tile + 1, 3 * tile + 5):
            ph, pw = grid.priced_at(h, w)
            whole = grid.tiles(h, w) is None
            assert (grid.tiles(ph, pw) is None) == whole, (h, w)
            for size, priced in ((h, ph), (w, pw)):
                spans, priced_spans = axis.spans(size), axis.spans(priced)
                if whole:
                    assert size <= priced <= tile
                else:
                    assert len(priced_spans) == len(spans), (size, priced)
                    assert all(map(int.__le__, spans, priced_spans)), (size, priced)
                assert priced % axis.step == 0 or priced in (tile, len(spans) * stride), (size, priced)
