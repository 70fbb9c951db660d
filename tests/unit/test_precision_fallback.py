"""fp16 decodes whose output overflows, decoded again in fp32 (engine/execution/fallback.py): an item that
falls back is bit-identical to the fp32 deployment's `lossless` answer for its latent, items that
did not overflow keep their fp16 answer, the answer names which items fell back, streams hand the
fp32 frames over from the chunk that failed, and the fp32 weights are counted, made once and
released. Test models: tiny decoders whose first conv is scaled so that large latents overflow
fp16 while fp32 stays finite (tests/models.py); every engine loads the same saved folder."""

import asyncio

import pytest
import torch

from tests.models import OVERFLOW_LATENTS, load_reference, overflowing_vae, save_vae, torch_threads
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.execution.video import FrameChunk
from vae_service.engine.media.postprocess import to_uint8
from vae_service.engine.request.errors import DecodeFailed
from vae_service.serving.decode_service import DecodeService

KINDS = ["kl", "flux", "wan"]
CHANNELS = {"kl": 4, "flux": 8, "wan": 4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {kind: save_vae(overflowing_vae(kind), tmp_path_factory.mktemp(f"overflow-{kind}")) for kind in KINDS}


def config(folder, precision, **extra) -> ServiceConfig:
    return ServiceConfig(model=str(folder), decode_precision=precision, device="cpu", cpu_threads=1, **extra)


@pytest.fixture(scope="module")
def engines(folders):
    """kind -> {fp16, fp32, fp16 with the fallback off}, each loaded from the kind's folder."""
    return {
        kind: {
            "fp16": DecodeEngine(config(folder, "fp16")),
            "fp32": DecodeEngine(config(folder, "fp32")),
            "off": DecodeEngine(config(folder, "fp16", precision_fallback=False)),
        }
        for kind, folder in folders.items()
    }


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
    assert (done.fallback, done.retried_from_frame, done.precision) == ((0,), 1, "fp32")
    reference = decode(fp32, z).output
    streamed = torch.cat([c.pixels for c in chunks], 1)
    assert torch.equal(streamed[:, 1:], reference[:, 1:])  # the fp32 frames
    high16 = decode(DecodeEngine(config(folders["wan"], "fp16", precision_fallback=False)), z[:, :, :1], "high")
    assert torch.equal(streamed[:, :1], high16.output)  # frame 0: fp16 `high`, as first sent
    whole = decode(fp16.engine, z, "high")
    assert whole.fallback == (0,) and torch.equal(whole.output, reference)  # the whole answer: all fp32
