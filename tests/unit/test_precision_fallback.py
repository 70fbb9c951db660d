"""fp16 decodes whose output overflows, decoded again in fp32 (engine/execution/fallback.py): an item that
falls back is bit-identical to the fp32 deployment's `lossless` answer for its latent, items that
did not overflow keep their fp16 answer, the answer names which items fell back, streams hand the
fp32 frames over from the chunk that failed, and the fp32 weights are counted, made once and
released. Test models: tiny decoders whose first conv is scaled so that large latents overflow
fp16 while fp32 stays finite (tests/models.py); every engine loads the same saved folder."""

import asyncio
from contextlib import contextmanager

import pytest
import torch

from tests.models import OVERFLOW_LATENTS, load_reference, overflowing_vae, save_vae, torch_threads
from vae_service.config import Limits, ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, LimitExceeded
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.media.postprocess import to_uint8
from vae_service.engine.planning.planner import ClassTiles, plan_batch
from vae_service.engine.pricing.memory import LiveBytes
from vae_service.engine.request.errors import DecodeFailed
from vae_service.protocol.errors import wire_error
from vae_service.serving.decode_service import DecodeService

KINDS = ["kl", "flux", "wan"]
CHANNELS = {"kl": 4, "flux": 8, "wan": 4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {kind: save_vae(overflowing_vae(kind), tmp_path_factory.mktemp(f"overflow-{kind}")) for kind in KINDS}


def config(folder, precision, **extra) -> ServiceConfig:
    return ServiceConfig(model=str(folder), decode_precision=precision, device="cpu", cpu_threads=1, **extra)


class Engines(dict):
    """kind -> {fp16, fp32, fp16 with the fallback off}, each loaded from the kind's folder when a
    test first asks for the kind."""

    def __init__(self, folders):
        super().__init__()
        self.folders = folders

    def __missing__(self, kind: str) -> dict:
        folder = self.folders[kind]
        self[kind] = {
            "fp16": DecodeEngine(config(folder, "fp16")),
            "fp32": DecodeEngine(config(folder, "fp32")),
            "off": DecodeEngine(config(folder, "fp16", precision_fallback=False)),
        }
        return self[kind]


@pytest.fixture(scope="module")
def engines(folders):
    return Engines(folders)


def latents(kind: str, items: int, overflow: list[int], shape=(7, 5), frames: int = 3, seed: int = 0):
    """Items in `overflow` scaled so that fp16 overflows on them (odd latent sizes on purpose)."""
    g = torch.Generator().manual_seed(seed)
    dims = (frames, *shape) if kind == "wan" else shape
    z = torch.randn(items, CHANNELS[kind], *dims, generator=g)
    for i in overflow:
        z[i] *= OVERFLOW_LATENTS
    return z


def decode(engine: DecodeEngine, z, quality="lossless", output="uint8", **kw):
    return engine.decode([engine.prepare(DecodeRequest(z, quality, output, **kw))])[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("output", ["uint8", "float"])
def test_an_item_that_overflows_is_the_fp32_deployments_lossless_answer_and_the_others_keep_theirs(
    engines, kind, quality, output
):
    fp16, fp32, off = engines[kind]["fp16"], engines[kind]["fp32"], engines[kind]["off"]
    z = latents(kind, 3, overflow=[1])
    result = decode(fp16, z, quality, output)
    reference = decode(fp32, z, "lossless", output).output
    assert result.fallback == (1,) and result.precision == "fp16"
    assert torch.equal(result.output[1], reference[1])
    # the other items: fp16's own answer (a float answer is fp32 now, which holds fp16 exactly)
    fine = decode(off, z[[0, 2]], quality, output).output
    assert torch.equal(result.output[[0, 2]], fine.to(result.output.dtype))
    assert result.output.dtype == (torch.float32 if output == "float" else torch.uint8)


@pytest.mark.parametrize("kind", KINDS)
def test_every_item_fell_back_names_fp32_and_the_fallback_off_answers_as_before(engines, kind):
    z = latents(kind, 2, overflow=[0, 1], seed=1)
    result = decode(engines[kind]["fp16"], z)
    assert (result.precision, result.fallback) == ("fp32", (0, 1))
    assert torch.equal(result.output, decode(engines[kind]["fp32"], z).output)
    failed = decode(engines[kind]["off"], z)
    assert isinstance(failed, DecodeFailed) and failed.field == "latents"  # 422 on every wire


@pytest.mark.parametrize("kind", KINDS)
def test_finite_answers_do_not_touch_the_fallback(engines, kind):
    fp16, off = engines[kind]["fp16"], engines[kind]["off"]
    z = latents(kind, 2, overflow=[], seed=2)
    before = fp16.fallback.items
    result = decode(fp16, z, "high")
    assert result.fallback == () and result.precision == "fp16" and fp16.fallback.items == before
    assert torch.equal(result.output, decode(off, z, "high").output)


def test_the_class_tiled_decode_falls_back_to_the_fp32_class_tiled_decode(folders):
    """A request decoded by the class's own tiled decode (`tiling: model`, as above the bound) falls
    back to the fp32 deployment's answer for it: diffusers' fp32 `vae.enable_tiling(); vae.decode`
    of the folder, bit for bit (the engine's tiled `lossless` is that decode: test_tiling.py)."""
    fp16 = DecodeEngine(config(folders["kl"], "fp16"))
    z = latents("kl", 1, overflow=[0], shape=(40, 36), seed=3)
    result = decode(fp16, z, tiling="model")
    reference = load_reference(folders["kl"])
    reference.enable_tiling()
    with torch_threads(1), torch.inference_mode():
        pixels = to_uint8(reference.decode(z / reference.config.scaling_factor).sample)
    assert result.tiled and result.fallback == (0,) and result.precision == "fp32"
    assert torch.equal(result.output, pixels)


def test_the_fp32_weights_are_reserved_made_once_and_released(engines, folders):
    fp16, fp32 = engines["kl"]["fp16"], engines["kl"]["fp32"]
    weights = sum(p.numel() for p in fp16.vae.parameters()) * 4
    budget16, budget32 = fp16.cost.budget, fp32.cost.budget
    assert budget16.fallback >= weights and budget32.fallback == 0
    assert engines["kl"]["off"].cost.budget.fallback == 0
    assert fp16.describe()["precision_fallback"]["enabled"] is True
    assert fp32.describe()["precision_fallback"]["enabled"] is False
    assert fp16.describe()["memory_plan"]["fallback_bytes"] == budget16.fallback

    engine = DecodeEngine(config(folders["kl"], "fp16"))
    assert not engine.fallback.loaded  # nothing made before an item needs it
    z = latents("kl", 1, overflow=[0], seed=4)
    first = decode(engine, z)
    runtime = engine.fallback._fp32
    decode(engine, latents("kl", 1, overflow=[0], seed=5))
    assert engine.fallback._fp32 is runtime  # made once
    assert engine.release_folded() >= weights and not engine.fallback.loaded
    assert torch.equal(decode(engine, z).output, first.output)  # made again when needed


def test_a_stream_hands_over_the_fp32_frames_from_the_chunk_that_failed(folders):
    """Latent frame 0 decodes finite in fp16 and goes out; frame 1 overflows: the item is decoded
    again in fp32 and the stream passes on its frames from 1 on, saying so in its result."""
    fp16 = DecodeService(config(folders["wan"], "fp16"))
    fp32 = DecodeEngine(config(folders["wan"], "fp32"))
    z = latents("wan", 1, overflow=[], frames=3, seed=6)
    z[:, :, 1:] *= OVERFLOW_LATENTS

    async def stream():
        s = await fp16.submit(lambda: DecodeRequest(z, "high", stream=True), z.nbytes)
        return [e async for e in s.events()]

    events = asyncio.run(stream())
    chunks, done = events[:-1], events[-1]
    assert all(isinstance(c, FrameChunk) for c in chunks)
    assert [c.frame for c in chunks] == [0, 1, 5]
    assert (done.fallback, done.retried_from_frame, done.precision) == ((0,), 1, "fp16")  # frame 0 was fp16
    assert done.fallback_from_frame == (1,)
    reference = decode(fp32, z).output
    streamed = torch.cat([c.pixels for c in chunks], 1)
    assert torch.equal(streamed[:, 1:], reference[:, 1:])  # the fp32 frames
    high16 = decode(DecodeEngine(config(folders["wan"], "fp16", precision_fallback=False)), z[:, :, :1], "high")
    assert torch.equal(streamed[:, :1], high16.output)  # frame 0: fp16 `high`, as first sent
    whole = decode(fp16.engine, z, "high")
    assert whole.fallback == (0,) and torch.equal(whole.output, reference)  # the whole answer: all fp32


# ---- the fallback's decode is planned within the bound, like any decode (issue 41) -------------


@contextmanager
def bounded(engine: DecodeEngine, bound: int):
    """`engine` planning under max_decode_bytes `bound` until the block ends."""
    engine.limits = Limits(max_decode_bytes=bound)
    try:
        yield engine
    finally:
        engine.limits = Limits()


def live_peak(engine: DecodeEngine, prepared) -> tuple[int, object]:
    """The live bytes of a real decode through the engine, counted as the price counts them."""
    live = LiveBytes()
    with torch_threads(1), live:
        (result,) = engine.decode([prepared])
    return live.peak, result


@pytest.mark.parametrize("quality, output, items, overflow", [("lossless", "uint8", 1, [0]), ("high", "float", 2, [1])])
def test_a_fallback_that_would_not_fit_whole_decodes_by_the_fp32_plan_within_the_bound(
    engines, quality, output, items, overflow
):
    """The bound admits the fp16 decode whole, not the fp32 one: the item that overflows is decoded
    again by the class's own tiled decode at fp32, as the fp32 deployment with the same bound
    decodes it (its bits, its `tiled`), and the decode's live bytes stay within the bound (the fp32
    weights are reserved apart, loaded before counting)."""
    fp16, fp32 = engines["kl"]["fp16"], engines["kl"]["fp32"]
    z = latents("kl", items, overflow=overflow, shape=(11, 13), seed=7)
    request = DecodeRequest(z, quality, output)
    as_fp32 = DecodeRequest(z, "lossless", output)
    first = fp16.peak_bytes(fp16.prepare(request))
    whole, tiled = fp32.peak_bytes(fp32.prepare(as_fp32)), fp32.cost.class_tiled_peak(fp32.prepare(as_fp32))
    assert max(first, tiled) < whole  # a bound between them: fp16 whole, fp32 only in tiles
    bound = (max(first, tiled) + whole) // 2
    with bounded(fp16, bound), bounded(fp32, bound):
        prepared, reference = fp16.prepare(request), fp32.prepare(as_fp32)
        assert prepared.tiling is None and isinstance(reference.tiling, ClassTiles)
        with torch_threads(1):
            fp16.decode([prepared])  # the fp32 copy loaded (reserved apart), folded weights built
            peak, result = live_peak(fp16, prepared)
            (want,) = fp32.decode([reference])
    assert result.fallback == tuple(overflow) and want.tiled and result.tiled
    assert result.precision == ("fp32" if items == 1 else "fp16")
    assert torch.equal(result.output[overflow], want.output[overflow])
    assert peak <= bound, f"{peak} > {bound}"


@pytest.mark.parametrize(
    "tiling, shape, field",
    [("none", (11, 13), "tiling"), ("auto", (9, 9), "latents"), ("model", (9, 9), "tiling")],
)
def test_a_request_whose_fp32_plan_cannot_fit_is_refused_up_front(engines, tiling, shape, field):
    """The bound holds the fp16 plan exactly; the fp32 fallback's plan for the same request (whole
    for 'none', whole or the class's tiled decode for 'auto', that tiled decode for 'model') does
    not fit it: 413 naming the field, before anything is queued. With the fallback off the same
    request is admitted."""
    fp16, off = engines["kl"]["fp16"], engines["kl"]["off"]
    request = DecodeRequest(latents("kl", 1, overflow=[0], shape=shape), tiling=tiling)
    prepared = off.prepare(request)
    bound = off.cost.class_tiled_peak(prepared) if tiling == "model" else off.peak_bytes(prepared)
    with bounded(off, bound):
        assert off.prepare(request).tiling == (ClassTiles() if tiling == "model" else None)
    with bounded(fp16, bound), pytest.raises(LimitExceeded) as refused:
        fp16.prepare(request)
    assert refused.value.field == field and "precision_fallback" in refused.value.message
    assert wire_error(refused.value).http_status == 413


def test_high_requests_decode_together_only_where_one_can_fall_back_beside_the_others(engines):
    """Requests decoded together hold one output tensor: one falling back holds it all beside its
    fp32 decode. Where that does not fit the bound they run one by one; without the fallback,
    together."""
    fp16, off = engines["kl"]["fp16"], engines["kl"]["off"]
    batch = [fp16.prepare(DecodeRequest(latents("kl", 1, overflow=[], shape=(9, 9), seed=s), "high")) for s in (1, 2)]
    together = sum(fp16.cost.peak(r) for r in batch)
    cost = fp16.cost
    beside = sum(cost.held_after_decode(r) for r in batch) + cost.fallback_peak(batch[0], False)
    assert together < beside  # a bound between them
    bound = (together + beside) // 2
    assert [run.members for run in plan_batch(batch, fp16.cost, bound).runs] == [(0,), (1,)]
    assert [run.members for run in plan_batch(batch, off.cost, bound).runs] == [(0, 1)]
    assert [run.members for run in plan_batch(batch, fp16.cost, beside).runs] == [(0, 1)]
    plan = plan_batch(batch, fp16.cost, bound)
    assert plan.fallbacks == (None, None) and plan_batch(batch, off.cost, bound).fallbacks == ()


def test_the_fallbacks_price_is_the_fp32_deployments(engines):
    """Priced on a meta twin at fp32 (no fp32 weights loaded): the fp32 engine's own prices, and
    shown in /health beside the engine's."""
    fp16, fp32 = engines["kl"]["fp16"], engines["kl"]["fp32"]
    assert fp32.cost.fallback is None and engines["kl"]["off"].cost.fallback is None
    for shape in [(9, 9), (11, 13), (40, 36)]:
        prepared = fp32.prepare(DecodeRequest(torch.randn(2, 4, *shape)))
        assert fp16.cost.fallback.peak(prepared, "lossless") == fp32.cost.peak(prepared)
        assert fp16.cost.fallback.class_tiled_peak(prepared) == fp32.cost.class_tiled_peak(prepared)
    plan = fp16.describe()["memory_plan"]
    assert plan["fallback_tiers_fp32"]["lossless"] == fp32.describe()["memory_plan"]["tiers"]["lossless"]
    assert "fallback_tiers_fp32" not in fp32.describe()["memory_plan"]
