"""One conformance suite for the decode core's promises (issue 41, item 6; docs/architecture.md).
Rows: the ways a request can be decoded
(tests/conformance_rows.py: tiers x tiling auto / model / none x stream none / frames / mp4 / webm x
fallback off / triggered x tiles local / shared x image / causal video, a covering set of them).
Columns, one test function each, parametrized over every row, so a new row inherits them all:

- the memory bound: a real decode's peak live tensor bytes (engine/pricing/memory.py's LiveBytes,
  as the price counts them) within the price of the plan the request was admitted with (the
  fallback's fp32 plan included where it runs), and within the bound;
- bounded cost: from the moment the request's deadline passes, or its caller abandons it, to the
  device thread being free: at most one wait slice plus one decoder call of that row (measured), and
  the answer is that timeout or abandonment where decoder calls were left;
- exact bits: the answer (or the stream joined) is its reference bit for bit: diffusers' own decode
  of the saved folder (`from_pretrained`, never the in-memory model) for `lossless`, the fp32
  deployment's answer for the items that fell back, the local tiles for shared ones, the whole
  answer for a stream (where a stream says a retry or a fallback began at some frame, the frames
  before it are the first decode's);
- honest answers: `quality`, `precision`, `tiled`, `replicas`, `fallback` (and a stream's
  `fallback_from_frame`, `retried_from_frame`) say what happened.

Engine level, no Ray: DecodeEngine on a device thread of its own (as the service's), streams through
serving's framework-free FrameStream / VideoStream, shared tiles with an in-process peer replica
(tests/peers.py). Engines are built once per module, each from a saved folder, as the service
loads them. A row's answer is decoded once and cached; each column adds only its own runs."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import pytest
import torch

from tests.conformance_rows import ROWS, VIDEOS, Row
from tests.interloping import Interloping
from tests.models import OVERFLOW_LATENTS, at_precision, load_reference, overflowing_vae, save_vae, torch_threads
from tests.peers import Deployment, Replica, here_only
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.media.encoding import encode_item
from vae_service.engine.media.postprocess import to_uint8
from vae_service.engine.planning.planner import ClassTiles, plan_fallback
from vae_service.engine.planning.tiling import TileGrid
from vae_service.engine.pricing.memory import LiveBytes
from vae_service.engine.request.context import WAIT_SLICE_S, RequestContext
from vae_service.engine.request.errors import DecodeAbandoned, DecodeTimeout
from vae_service.engine.request.result import DecodeResult
from vae_service.engine.runtime import wan_walk
from vae_service.serving.outputs.encoders import EncoderPool
from vae_service.serving.outputs.frame_stream import FrameStream
from vae_service.serving.outputs.video_stream import VideoStream
from vae_service_client.mp4 import Mp4Fragment

RUN_TIMEOUT_S = 120.0  # a request's deadline where the run is not about deadlines (a hang fails, late)
# Scheduling margin of the stop column, beside the slice and the decoder call it allows: the device
# thread, the stream's event loop and the peer replica's threads share this host's 2 cores (and the
# GIL) with other suites, so a thread that became runnable can wait some tens of ms for a core.
MARGIN_S = 0.1
TIGHT_HIGH = {"kl": 0.8, "wan": 0.9}  # a `high` bound, as a fraction of the whole price: tiles (Wan: in lockstep)
# `high`'s documented error against `lossless` (docs/fast-path.md): fp32 max 1e-3 / uint8 PSNR 50 dB;
# fp16/bf16 at most twice lossless' own error against fp32; tiled against untiled (docs/performance.md)
HIGH_MAX_ABS_FP32, HIGH_MIN_PSNR_FP32, LOW_PRECISION_ERROR_RATIO, MIN_TILED_PSNR_DB = 1e-3, 50.0, 2.0, 25.0


# ---- decoder calls: how long one takes, and where a stop is injected ---------------------------------
class Calls:
    """The decoder calls of the run on the device thread: a decoder's forward (images, tiles, the
    class's own tiled decode, the fp32 fallback's decoder), one chunk of the Wan walk (one latent
    frame; the walk calls the decoder's modules itself) or a preview's map, with their durations
    and whose they were. `arm(k, stop)`: `stop()` runs when the k-th call starts (its checkpoint
    passed: the whole call runs before the decode can see the stop, the worst case the promise
    allows), or `after_s` into the run if that comes first (the device thread may be waiting for a
    peer's tiles instead)."""

    def __init__(self) -> None:
        self.ident: int | None = None
        self.fallback_decoders: set[int] = set()  # ids of fp32 fallback decoders
        self.lock = threading.Lock()
        self.durations: list[float] = []
        self.kinds: list[str] = []  # "first" | "fallback", per call
        self.started: float | None = None
        self.stop_at, self.stop, self.after_s, self.timer = None, None, None, None
        self.stopped_at: float | None = None

    def arm(self, k: int | None, stop, after_s: float | None = None) -> None:
        self.stop_at, self.stop, self.after_s = k, stop, after_s

    def begin_run(self) -> None:
        self.ident, self.started, self.stopped_at = threading.get_ident(), None, None
        self.durations, self.kinds = [], []
        if self.stop is not None and self.after_s is not None:
            self.timer = threading.Timer(self.after_s, self._fire)
            self.timer.start()

    def end_run(self) -> None:
        self.ident = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self) -> None:
        with self.lock:
            stop, self.stop = self.stop, None
            if stop is None:
                return
            self.stopped_at = time.perf_counter()
        stop()

    def start(self, decoder) -> None:
        if threading.get_ident() != self.ident:
            return
        self.kinds.append("fallback" if id(decoder) in self.fallback_decoders else "first")
        if len(self.kinds) == self.stop_at:
            self._fire()
        self.started = time.perf_counter()

    def end(self) -> None:
        if threading.get_ident() == self.ident and self.started is not None:
            self.durations.append(time.perf_counter() - self.started)
            self.started = None


CALLS = Calls()


def watch(decoder: torch.nn.Module, fallback: bool = False) -> None:
    """Time `decoder`'s forwards (registered after the engine's checkpoint hook: they start after it)."""
    if fallback:
        CALLS.fallback_decoders.add(id(decoder))
    decoder.register_forward_pre_hook(lambda module, args: CALLS.start(module))
    decoder.register_forward_hook(lambda module, args, out: CALLS.end())


@pytest.fixture(scope="module", autouse=True)
def timed_walk():
    """Each chunk of the Wan walk is one decoder call (one latent frame)."""
    chunk = wan_walk.Walk.chunk

    def timed(self, x):
        CALLS.start(self.d)
        try:
            return chunk(self, x)
        finally:
            CALLS.end()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wan_walk.Walk, "chunk", timed)
        yield


# ---- engines: one per (model, precision), each with its device thread and, when asked, a peer ------
def engine_config(folder, model: str, precision: str) -> ServiceConfig:
    return ServiceConfig(model=str(folder), model_name=model, device="cpu", cpu_threads=1, decode_precision=precision)


class Setup:
    """One deployment: its engine, its device thread (as the service's: bound to the engine), its
    encoder pool, and a peer replica of the same folder and settings (built when a row shares)."""

    def __init__(self, folder, model: str, precision: str):
        self.folder, self.model, self.precision = folder, model, precision
        with torch_threads(torch.get_num_threads()):  # an engine binds the thread that builds it
            self.engine = DecodeEngine(engine_config(folder, model, precision))
        self.device = ThreadPoolExecutor(1, thread_name_prefix=f"device-{model}-{precision}")
        self.device.submit(self.engine.bind_thread).result()
        self.encoders = EncoderPool(self.engine.encode_settings, 1)
        self._peers: Deployment | None = None
        self._references: dict[bool, torch.nn.Module] = {}
        self.warm()

    def warm(self) -> None:
        """Decode once per tier (the fast path's folded weights built), and for fp16 an item that
        overflows (the fp32 fallback's copy loaded): both are held like weights, not per decode."""
        engine, video = self.engine, self.model == "wan"
        z = torch.randn(1, 4, *((1,) if video else ()), 4, 4, generator=torch.Generator().manual_seed(0))
        for quality in ("lossless", "high"):
            self.device.submit(engine.decode, [engine.prepare(DecodeRequest(z, quality, latents_scaled=True))]).result()
        if engine.fallback.enabled:
            request = DecodeRequest(z * OVERFLOW_LATENTS, latents_scaled=True)
            (result,) = self.device.submit(engine.decode, [engine.prepare(request)]).result()
            assert result.fallback == (0,), "the warm-up did not overflow fp16"
        watch(getattr(engine.vae, "decoder", engine.vae))
        preview = engine.preview.image  # a preview's one call per image or latent frame

        def timed_preview(z):
            CALLS.start(engine.preview)
            try:
                return preview(z)
            finally:
                CALLS.end()

        engine.preview.image = timed_preview
        if engine.fallback.loaded:
            fp32 = engine.fallback._fp32.vae
            watch(getattr(fp32, "decoder", fp32), fallback=True)

    def peers(self) -> Deployment:
        if self._peers is None:
            with torch_threads(torch.get_num_threads()):
                peer = DecodeEngine(engine_config(self.folder, self.model, self.precision))
            self._peers = Deployment([Replica(f"{self.model}-{self.precision}-peer", peer)])
        return self._peers

    def reference(self, tiled: bool) -> torch.nn.Module:
        """diffusers' own `from_pretrained` of the saved folder at this precision (tiling on: its
        `enable_tiling`)."""
        if tiled not in self._references:
            vae = at_precision(load_reference(self.folder), self.engine.dtype)
            if tiled:
                vae.enable_tiling()
            self._references[tiled] = vae
        return self._references[tiled]

    def close(self) -> None:
        self.device.shutdown(wait=True)
        self.encoders.shutdown()


class Setups(dict):
    def __init__(self, tmp_path_factory):
        super().__init__()
        self.folders = {}
        self.tmp = tmp_path_factory

    def __missing__(self, key: tuple[str, str]) -> Setup:
        model, precision = key
        if model not in self.folders:
            self.folders[model] = save_vae(overflowing_vae(model), self.tmp.mktemp(f"conformance-{model}"))
        self[key] = Setup(self.folders[model], model, precision)
        return self[key]


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    built = Setups(tmp_path_factory)
    yield built
    for setup in built.values():
        setup.close()


# ---- running a row ----------------------------------------------------------------------------------
@dataclass
class Ran:
    """One decode of a row on the device thread."""

    result: object  # DecodeResult, or the exception (returned or raised) that answered it
    began: float  # time.perf_counter() when the device thread took it
    freed_at: float  # ... and was free again
    peak: int | None  # LiveBytes' peak, when measured
    calls: list[float]  # durations of its decoder calls
    kinds: list[str]
    stopped_at: float | None
    chunks: list = field(default_factory=list)  # a stream's events: FrameChunks or Mp4Fragments
    done: object = None  # a stream's final DecodeResult, or the exception it ended with


def fresh(prepared, setup: Setup):
    """The request again, arriving now: its plan, its limits, a context of its own."""
    context = RequestContext.admit(RUN_TIMEOUT_S, prepared.context.limits, setup.engine.fingerprint)
    return replace(prepared, context=context)


def _on_device(setup: Setup, prepared, peers, measure: bool, steps: Interloping | None = None) -> Ran:
    began = time.perf_counter()
    CALLS.begin_run()
    live = LiveBytes() if measure else None
    if steps is not None:
        steps.turn.take()
    try:
        with live if live is not None else nullcontext():
            (result,) = setup.engine.decode([prepared], peers=peers, steps=steps)
    except Exception as exc:  # the answer under test
        result = exc
    finally:
        freed = time.perf_counter()
        CALLS.end_run()
        if steps is not None:
            steps.turn.release()
    return Ran(result, began, freed, live.peak if live else None, CALLS.durations, CALLS.kinds, CALLS.stopped_at)


def _kept(event):
    """A stream's event as its client keeps it: a copy made off the device thread (so the decode's
    live bytes do not count what the client holds on to)."""
    if isinstance(event, FrameChunk):
        return replace(event, pixels=event.pixels.clone())
    return event


async def _streamed(setup: Setup, prepared, peers, measure: bool, steps: Interloping | None = None) -> Ran:
    """The request streamed as serving/decode_service.py streams it, without its batcher: the decode
    on the device thread handing chunks to a FrameStream (a VideoStream over it for mp4), a reader
    taking every event; a reader that leaves abandons the request."""
    context = prepared.context
    frames = FrameStream(prepared.items, context)
    on_device = setup.device.submit(_on_device, setup, replace(prepared, sink=frames.sink), peers, measure, steps)

    async def decoded() -> DecodeResult:
        try:
            ran = await asyncio.wrap_future(on_device)
        except asyncio.CancelledError:
            context.abandon()
            raise
        if isinstance(ran.result, Exception):
            raise ran.result
        return ran.result

    decode = asyncio.ensure_future(decoded())
    stream = frames
    if prepared.request.output in VIDEOS:
        output = prepared.request.output
        stream = VideoStream(frames, setup.encoders, output, setup.engine.video_fragments(prepared), context)
    events, done = [], None
    try:
        await stream.start(decode)
        async for event in stream.events():
            events.append(_kept(event))
    except Exception as exc:  # the answer under test
        done = exc
    ran = await asyncio.to_thread(on_device.result, RUN_TIMEOUT_S)
    if done is None:
        done = events.pop()
    ran.chunks, ran.done = events, done
    return ran


def run(setup: Setup, prepared, peers=None, measure: bool = False, steps: Interloping | None = None) -> Ran:
    """One decode of a prepared row on the device thread (`steps`: suspended at its step boundaries)."""
    if prepared.request.stream:
        return asyncio.run(_streamed(setup, prepared, peers, measure, steps))
    return setup.device.submit(_on_device, setup, prepared, peers, measure, steps).result(RUN_TIMEOUT_S)


def latents_of(row: Row) -> torch.Tensor:
    g = torch.Generator().manual_seed(ROWS.index(row))
    z = torch.randn(*row.latent, generator=g)
    for item in row.overflow:
        if row.video:
            z[item, :, row.overflow_from :] *= OVERFLOW_LATENTS
        else:
            z[item] *= OVERFLOW_LATENTS
    return z


def request_of(row: Row, z: torch.Tensor, **changes) -> DecodeRequest:
    fields = dict(quality=row.quality, output=row.output, stream=row.streamed, tiling=row.tiling)
    return DecodeRequest(z, latents_scaled=True, **{**fields, **changes})


def tight_bound(engine: DecodeEngine, request: DecodeRequest, row: Row) -> int:
    """A bound under the request's whole price: `lossless` just under it (the class's own tiled
    decode), `high` a fraction of it (a tile grid)."""
    whole = engine.cost.peak(engine.check(request))
    return whole - 1 if row.quality == "lossless" else int(TIGHT_HIGH[row.model] * whole)


@dataclass
class Outcome:
    """A row prepared as the service prepares it, and its answer (decoded once)."""

    row: Row
    setup: Setup
    z: torch.Tensor
    bound: int | None
    prepared: object
    ran: Ran
    took: int  # tiles the peer replica took (shared rows)

    @property
    def answer(self):
        """The DecodeResult a client ends with (a stream's: its final result)."""
        return self.ran.done if self.row.streamed else self.ran.result

    def context(self) -> RequestContext:
        return RequestContext.admit(RUN_TIMEOUT_S, Limits(max_decode_bytes=self.bound), self.setup.engine.fingerprint)

    def peers(self):
        return self.setup.peers() if self.row.shared else None

    def decode(
        self,
        setup: Setup | None = None,
        same_plan: bool = False,
        z: torch.Tensor | None = None,
        bounded: bool = True,
        **changes,
    ):
        """The same latents (or `z`) asked otherwise (`changes` to the request), on `setup` (default:
        this row's deployment), under the row's bound (`bounded`; else the default one), decoded
        here, whole; its DecodeResult. `same_plan`: by this row's plan (else by the one its
        deployment makes for it)."""
        setup = setup or self.setup
        request = request_of(self.row, self.z if z is None else z, **{"stream": False, **changes})
        context = self.context() if bounded else setup.engine.context(RUN_TIMEOUT_S)
        if same_plan:
            prepared = replace(setup.engine.check(request, context), tiling=self.prepared.tiling)
        else:
            prepared = setup.engine.prepare(request, context)
        (result,) = setup.device.submit(setup.engine.decode, [prepared]).result()
        assert isinstance(result, DecodeResult), said(result)
        return result


def check_plan(row: Row, prepared) -> None:
    """The row is the way it names (else the row's shape or bound is wrong, not the engine)."""
    tiling = prepared.tiling
    want = {"tight": ClassTiles if row.quality == "lossless" else TileGrid}.get(row.bound, type(None))
    if row.tiling == "model":
        want = ClassTiles
    assert isinstance(tiling, want), f"row {row.name} planned {tiling}, not a {want.__name__}"
    if isinstance(tiling, TileGrid):
        assert len(tiling.tiles()) >= 2 and not tiling.optional, tiling
        assert not row.shared or (tiling.lockstep and tiling.ahead > 0), f"a grid not shared: {tiling}"


class Outcomes(dict):
    def __init__(self, setups: Setups):
        super().__init__()
        self.setups = setups

    def __missing__(self, row: Row) -> Outcome:
        setup = self.setups[row.model, row.precision]
        engine, z = setup.engine, latents_of(row)
        request = request_of(row, z)
        bound = tight_bound(engine, request, row) if row.bound == "tight" else None
        context = RequestContext.admit(RUN_TIMEOUT_S, Limits(max_decode_bytes=bound), engine.fingerprint)
        prepared = engine.prepare(request, context)
        check_plan(row, prepared)
        peers = setup.peers() if row.shared else None
        before = sum(len(r.took) for r in peers.replicas) if peers else 0
        ran = run(setup, prepared, peers)
        took = sum(len(r.took) for r in peers.replicas) - before if peers else 0
        self[row] = Outcome(row, setup, z, bound, prepared, ran, took)
        return self[row]


@pytest.fixture(scope="module")
def outcomes(setups):
    return Outcomes(setups)


def ids(row: Row) -> str:
    return row.name


def said(answer) -> str:
    """An answer, short: an error as itself, a result by its facts (not its pixels)."""
    if not isinstance(answer, DecodeResult):
        return repr(answer)
    facts = ("precision", "quality", "tiled", "fallback", "fallback_from_frame", "retried_from_frame")
    return "DecodeResult(" + ", ".join(f"{name}={getattr(answer, name)!r}" for name in facts) + ")"


# ---- the memory bound -------------------------------------------------------------------------------
def price_of(outcome: Outcome) -> int:
    """The peak the request was admitted at: its plan's price (whole: the tier's; the class's own
    tiled decode: its grid's; a tile grid: the bound it was chosen to fit, its own figure not being
    exposed), and where its items fall back, the larger of that and the fp32 plan's price."""
    engine, prepared, row = outcome.setup.engine, outcome.prepared, outcome.row
    if isinstance(prepared.tiling, TileGrid):
        price = outcome.bound
    else:
        try:
            price = engine.peak_bytes(prepared)
        except KeyError as missing:
            pytest.fail(f"the engine has no price for a {row.quality} decode ({missing!r}): it is never priced")
    if row.triggered:
        cost = engine.cost
        bound = outcome.bound if outcome.bound is not None else cost.bound(prepared.context.limits)
        fp32_tiled = isinstance(plan_fallback(prepared, cost, bound), ClassTiles)
        price = max(price, cost.fallback_peak(prepared, fp32_tiled))
    return price


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_the_measured_peak_is_within_the_price(row, outcomes):
    """A real decode of the row on its device thread, its live tensor bytes counted as the price
    counts them (LiveBytes: on this thread; a peer's tiles are decoded on its own threads and what
    its outputs hold once handed over is not counted here, in-process)."""
    outcome = outcomes[row]
    ran = run(outcome.setup, fresh(outcome.prepared, outcome.setup), outcome.peers(), measure=True)
    answer = ran.done if row.streamed else ran.result
    assert isinstance(answer, DecodeResult), said(answer)
    price = price_of(outcome)
    peak = ran.peak
    assert peak <= price, (
        f"peak {peak} > price {price} ({peak / price:.3f}x, {peak - price:+d} B) planned {outcome.prepared.tiling}"
    )
    if outcome.bound is not None:
        assert peak <= outcome.bound, f"peak {peak} > bound {outcome.bound}"


# ---- bounded cost -----------------------------------------------------------------------------------
def stop_call(outcome: Outcome) -> int:
    """Which decoder call a stop comes at: the first of the fp32 fallback's where items fall back (its
    re-decode is work like any other), else the middle one; shared rows: the first decoded here, or
    halfway through the decode if that comes first (how many tiles the peer takes varies)."""
    kinds = outcome.ran.kinds
    if outcome.row.shared:
        return 1
    if "fallback" in kinds:
        return kinds.index("fallback") + 1
    return max(1, len(kinds) // 2)


@pytest.mark.parametrize("stop", ["deadline", "abandonment"])
@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_a_deadline_or_abandonment_frees_the_device_within_a_slice_and_a_call(row, stop, outcomes):
    outcome = outcomes[row]
    setup, k = outcome.setup, stop_call(outcome)
    assert outcome.ran.calls, "the row's decode made no decoder call on its device thread"
    prepared = fresh(outcome.prepared, setup)
    context = prepared.context

    def now() -> None:
        if stop == "deadline":
            context.deadline = time.monotonic()  # the deadline it was admitted with arrives now
        else:
            context.abandon()

    # shared rows: how many tiles this device decodes varies; the stop comes halfway through the
    # decode at the latest
    after_s = (outcome.ran.freed_at - outcome.ran.began) / 2 if row.shared else None
    CALLS.arm(k, now, after_s)
    try:
        ran = run(setup, prepared, outcome.peers())
    finally:
        CALLS.arm(None, None)
    assert ran.stopped_at is not None, f"the decode made fewer than {k} decoder calls: no stop came"
    freed_after = ran.freed_at - ran.stopped_at
    one_call = max(outcome.ran.calls + ran.calls)
    assert freed_after <= WAIT_SLICE_S + one_call + MARGIN_S, (
        f"the device thread was free {freed_after:.3f} s after the {stop}: over a slice ({WAIT_SLICE_S} s) "
        f"plus one decoder call ({one_call:.3f} s) plus {MARGIN_S} s; calls after it: {ran.kinds[k:]}"
    )
    if k < len(outcome.ran.kinds):  # decoder calls were left: the answer is the stop's, not pixels
        answer = ran.done if row.streamed else ran.result
        want = DecodeTimeout if stop == "deadline" else DecodeAbandoned
        assert type(answer) is want, f"answered {said(answer)} after the {stop}; calls after it: {ran.kinds[k:]}"


# ---- exact bits ---------------------------------------------------------------------------------------
def joined(chunks: list[FrameChunk], items: int) -> torch.Tensor:
    """Each item's frames joined along the frame axis, checking that they come in order, none twice."""
    per_item: list[list[torch.Tensor]] = [[] for _ in range(items)]
    sent = [0] * items
    for chunk in chunks:
        axis = chunk.frame_axis - 1  # without the item axis
        for j in range(chunk.pixels.shape[0]):
            item = chunk.item + j
            assert chunk.frame == sent[item], f"item {item}: frame {chunk.frame} after {sent[item]} frames"
            per_item[item].append(chunk.pixels[j])
            sent[item] += chunk.frames
    return torch.stack([torch.cat(frames, axis) for frames in per_item])


def frames_of(pixels: torch.Tensor, start: int, end: int | None = None) -> torch.Tensor:
    """Frames start..end of every item: uint8 [B, T, H, W, 3], float [B, 3, T, H, W]."""
    axis = 1 if pixels.dtype == torch.uint8 else 2
    end = pixels.shape[axis] if end is None else end
    return pixels.narrow(axis, start, end - start)


def first_frames(outcome: Outcome, item: int, count: int, output: str) -> torch.Tensor:
    """What the first decode handed over before `count` frames of `item`: the same deployment's
    decode, by the row's plan, of the latent frames that make them (finite: nothing falls back)."""
    engine, z = outcome.setup.engine, outcome.z[item : item + 1]
    latent_frames = next(t for t in range(1, z.shape[2] + 1) if engine.spec.output_frames(t) >= count)
    assert engine.spec.output_frames(latent_frames) == count, f"{count} frames end inside a latent frame"
    result = outcome.decode(same_plan=True, z=z[:, :, :latent_frames], output=output)
    assert not result.fallback, said(result)
    return result.output


def check_stream(outcome: Outcome) -> DecodeResult:
    """The stream joined is the whole answer, bit for bit; where it says a fallback (or a retry)
    began at some frame, the frames before it are the first decode's (a retry is visible, never
    silent). The whole answer, to check further."""
    row, done = outcome.row, outcome.ran.done
    assert isinstance(done, DecodeResult), said(done)
    output = "uint8" if row.output in VIDEOS else row.output
    whole = outcome.decode(same_plan=True, output=row.output)  # a video: its pixels, not yet encoded
    from_frame = dict(zip(done.fallback, done.fallback_from_frame or (), strict=False))
    expected = whole.output.clone()
    for item in range(row.items):
        start = from_frame.get(item, 0)
        if start:
            first = first_frames(outcome, item, start, output)
            frames_of(expected[item : item + 1], 0, start).copy_(first.to(expected.dtype))
    if row.output in VIDEOS:
        assert all(isinstance(c, Mp4Fragment) for c in outcome.ran.chunks)  # either container's fragments
        streamed = b"".join(c.data for c in outcome.ran.chunks)
        if expected.equal(whole.output):
            want = outcome.setup.engine.encode(whole).output[0]  # the whole answer's bytes
        else:  # the whole answer's encoding of the frames the stream says it sent
            fragments = outcome.setup.engine.video_fragments(outcome.prepared)
            want = encode_item(expected[0].numpy(), row.output, outcome.setup.engine.encode_settings, fragments)
        assert streamed == want, f"the {row.output} stream is not the whole answer of the frames it says it sent"
        return whole
    streamed = joined(outcome.ran.chunks, row.items)
    for item in range(row.items):
        start = from_frame.get(item, 0)
        mine, whole_item, first = (p[item : item + 1] for p in (streamed, whole.output, expected))
        assert torch.equal(frames_of(mine, start), frames_of(whole_item, start)), (
            f"item {item}: the frames streamed from frame {start} on are not the whole answer's"
        )
        assert torch.equal(frames_of(mine, 0, start), frames_of(first, 0, start)), (
            f"item {item}: the frames before {start} are not the first decode's"
        )
    return whole


def diffusers_decode(outcome: Outcome, items: list[int]) -> torch.Tensor:
    """diffusers' own decode of each item alone (tiled where the plan is the class's tiled decode),
    of the saved folder at the deployment's precision, with the deployment's thread count."""
    vae = outcome.setup.reference(isinstance(outcome.prepared.tiling, ClassTiles))
    z = outcome.z[items].to(outcome.setup.engine.dtype)
    with torch.inference_mode(), torch_threads(1):
        return torch.cat([vae.decode(item).sample for item in z.split(1)])


def as_output(pixels: torch.Tensor, output: str) -> torch.Tensor:
    return pixels if output == "float" else to_uint8(pixels)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def check_high_error(outcome: Outcome, answer: torch.Tensor, setups: Setups) -> None:
    """`high` without an exact reference: within its documented error of `lossless` (tiled: of its
    untiled decode)."""
    if isinstance(outcome.prepared.tiling, TileGrid):
        untiled = outcome.decode(bounded=False, tiling="none", output="uint8").output
        got = answer if answer.dtype == torch.uint8 else to_uint8(answer)
        assert psnr(got, untiled) >= MIN_TILED_PSNR_DB
        return
    lossless = outcome.decode(quality="lossless", output="float").output.float()
    high = (answer if answer.dtype != torch.uint8 else outcome.decode(output="float").output).float()
    if outcome.setup.engine.dtype == torch.float32:
        assert (high - lossless).abs().max().item() <= HIGH_MAX_ABS_FP32
        assert psnr(to_uint8(high), to_uint8(lossless)) >= HIGH_MIN_PSNR_FP32
        return
    fp32 = outcome.decode(setups[outcome.row.model, "fp32"], quality="lossless", output="float").output
    own = (lossless - fp32).abs().max().item()
    assert (high - fp32).abs().max().item() <= LOW_PRECISION_ERROR_RATIO * own


@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_the_answer_is_its_reference_bit_for_bit(row, outcomes, setups):
    outcome = outcomes[row]
    answer, exact = outcome.answer, False
    assert isinstance(answer, DecodeResult), said(answer)
    output = "uint8" if row.output in VIDEOS else row.output
    if row.shared:
        assert outcome.took > 0, "the peer took no tile: the row did not decode shared"
    if row.streamed:  # the whole answer it is checked against is decoded here, alone
        answer, exact = check_stream(outcome), True
    elif row.shared:
        local = here_only(fresh(outcome.prepared, outcome.setup))
        (alone,) = outcome.setup.device.submit(outcome.setup.engine.decode, [local]).result()
        assert isinstance(alone, DecodeResult), said(alone)
        assert torch.equal(answer.output, alone.output), "shared tiles are not the local tiles' answer"
        exact = True
    pixels = answer.output
    fell = list(row.overflow) if row.triggered else []
    if fell:  # the fp32 deployment's `lossless` answer, under the same bound
        fp32 = outcome.decode(setups[row.model, "fp32"], quality="lossless", output=output)
        assert torch.equal(pixels[fell], fp32.output[fell].to(pixels.dtype)), "a fallen-back item is not fp32's answer"
        exact = True
    rest = [i for i in range(row.items) if i not in fell]
    if row.quality == "lossless" and rest:
        want = as_output(diffusers_decode(outcome, rest), output)
        assert torch.equal(pixels[rest], want.to(pixels.dtype)), "lossless is not diffusers' decode of the folder"
        exact = True
    if exact:
        return
    if row.quality == "high":
        check_high_error(outcome, pixels, setups)
    else:  # preview: approximate by contract; the full decode's shape
        assert pixels.shape == outcome.decode(quality="lossless").output.shape


# ---- honest answers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_the_answer_says_what_happened(row, outcomes):
    outcome = outcomes[row]
    answer, engine, prepared = outcome.answer, outcome.setup.engine, outcome.prepared
    assert isinstance(answer, DecodeResult), said(answer)
    assert answer.quality == row.quality and answer.model == engine.spec.name
    fell = tuple(row.overflow) if row.triggered else ()
    assert answer.fallback == fell, f"fallback says {answer.fallback}, items {fell} overflowed"
    # frames the first decode handed over before an item fell back (a stream of a plan that hands
    # frames over per latent frame: the class's own tiled decode hands the clip over at once)
    per_frame = not isinstance(prepared.tiling, ClassTiles) and getattr(prepared.tiling, "lockstep", True)
    first_sent = row.streamed and row.triggered and row.overflow_from > 0 and per_frame
    all_fell = len(fell) == row.items and not first_sent
    assert answer.precision == ("fp32" if all_fell else engine.precision), answer.precision
    tiled = isinstance(prepared.tiling, (ClassTiles, TileGrid))
    if row.triggered:
        bound = outcome.bound if outcome.bound is not None else engine.cost.bound(prepared.context.limits)
        fp32_tiled = isinstance(plan_fallback(prepared, engine.cost, bound), ClassTiles)
        tiled = fp32_tiled if all_fell else tiled or fp32_tiled
    assert answer.tiled == tiled, f"tiled says {answer.tiled}; planned {prepared.tiling}"
    replicas = 1 + (1 if outcome.took else 0)  # this one, and the peer where it took tiles
    assert answer.timing.replicas == replicas, f"replicas says {answer.timing.replicas}, peer took {outcome.took}"
    if row.streamed:
        frames = engine.spec.output_frames(row.overflow_from) if first_sent else None
        assert answer.fallback_from_frame == ((frames,) if first_sent else (0,) * len(fell) or None)
        assert answer.retried_from_frame == (frames if first_sent else None)
        assert answer.output is None
    else:
        assert answer.fallback_from_frame is None and answer.retried_from_frame is None


# ---- preempted and resumed ----------------------------------------------------------------------------
@pytest.mark.parametrize("row", ROWS, ids=ids)
def test_a_preempted_and_resumed_decode_is_the_same_bits(row, outcomes):
    """Suspended at its step boundaries while other decodes of the same engine run to their end, the
    row answers the bits of its unpreempted decode (a stream: the same chunks, a video: the same
    bytes), each interloper the bits of its own decode alone, and its own live bytes stay within
    its price (a decode that takes turns may run its class's tiled decode as jobs, one per tile)."""
    outcome = outcomes[row]
    setup, first = outcome.setup, outcome.ran
    with Interloping(setup.engine) as gate:
        ran = run(setup, fresh(outcome.prepared, setup), outcome.peers(), measure=True, steps=gate)
    gate.check_interlopers(setup.device)
    assert ran.peak <= price_of(outcome), f"peak {ran.peak} > price {price_of(outcome)}"
    if row.streamed:
        assert isinstance(ran.done, DecodeResult), said(ran.done)
        if row.output in VIDEOS:
            assert b"".join(c.data for c in ran.chunks) == b"".join(c.data for c in first.chunks)
        else:
            assert torch.equal(joined(ran.chunks, row.items), joined(first.chunks, row.items))
        assert ran.done.fallback == first.done.fallback
    else:
        assert isinstance(ran.result, DecodeResult), said(ran.result)
        assert torch.equal(ran.result.output, first.result.output), "the preempted answer differs"
        assert (ran.result.fallback, ran.result.tiled) == (first.result.fallback, first.result.tiled)
