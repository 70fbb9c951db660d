"""Every class the service names, and two it does not, decoded by the engine: `lossless` is each
item's `vae.decode` alone after its pipeline's own normalisation, bit for bit, for several configs
per class, odd latent sizes and batch 2; FLUX.2's and Qwen-Image's denoiser forms; decode
timesteps; the generic path's answers to `high` and `stream`."""

from dataclasses import replace

import pytest
import torch

from tests.models import torch_threads
from tests.zoo import BY_NAME, CASES, build, decode_alone, latents
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest, InvalidInput
from vae_service.models.loading import LoadedVae


def engine_for(vae, name: str = "zoo", **config) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model=name, device="cpu", cpu_threads=1, **config), LoadedVae.of(vae, name))


def decode(engine, z, **kw):
    with torch_threads(1):
        (result,) = engine.decode([engine.prepare(DecodeRequest(z, output="float", **kw))])
    return result


@pytest.fixture(scope="module", params=[c.name for c in CASES])
def case_engine(request):
    case = BY_NAME[request.param]
    vae = build(case)
    return case, vae, engine_for(vae, case.name)


def test_lossless_is_the_pipelines_decode_of_each_item_alone(case_engine):
    case, vae, engine = case_engine
    z = latents(case, batch=2, seed=3)
    with torch_threads(1):
        expected = decode_alone(vae, case, z)
    result = decode(engine, z, decode_timestep=case.timestep)
    assert result.quality == "lossless" and result.output.shape == expected.shape
    assert torch.equal(result.output, expected)


def test_high_is_answered_by_the_fast_path_or_says_lossless(case_engine):
    case, vae, engine = case_engine
    z = latents(case, batch=2, seed=4)
    result = decode(engine, z, quality="high", decode_timestep=case.timestep)
    with torch_threads(1):
        expected = decode_alone(vae, case, z)
    if engine.spec.path == "generic":
        assert result.quality == "lossless" and torch.equal(result.output, expected)
        assert engine.describe()["tiers"] == ["lossless", "preview"]
    else:
        assert result.quality == "high" and engine.describe()["tiers"] == ["lossless", "high", "preview"]
        assert (result.output - expected).abs().max() < 1e-3


def test_health_names_the_path_geometry_and_normalisation(case_engine):
    case, vae, engine = case_engine
    health = engine.describe()
    expected_path = {
        "AutoencoderKL": "image_kl",
        "AutoencoderKLFlux2": "image_kl",
        "AutoencoderKLQwenImage": "causal_walk",
    }
    expected_path["AutoencoderKLWan"] = "causal_walk"
    assert health["decode_path"] == expected_path.get(case.cls, "generic")
    z = latents(case, batch=1)
    with torch_threads(1):
        out = decode_alone(vae, case, z)
    geometry = health["geometry"]
    h, w = (z.shape[-2] * 2, z.shape[-1] * 2) if case.cls == "AutoencoderKLFlux2" else z.shape[-2:]
    assert geometry["spatial_scale"] * h == out.shape[-2] and geometry["spatial_scale"] * w == out.shape[-1]
    assert health["class"] == case.cls and health["family"] == ("video" if case.video else "image")
    if "unnamed" in case.tags:
        assert health["normalisation_of"] == "the config's scaling_factor/shift_factor"


@pytest.mark.parametrize("name", [c.name for c in CASES if c.video])
def test_streamed_frames_are_the_whole_answer(name):
    case = BY_NAME[name]
    engine = engine_for(build(case), name)
    z = latents(case, batch=2, seed=5)
    whole = decode(engine, z, decode_timestep=case.timestep).output
    chunks = []
    with torch_threads(1):
        prepared = engine.prepare(DecodeRequest(z, output="float", stream=True, decode_timestep=case.timestep))
        (result,) = engine.decode([replace(prepared, sink=chunks.append)])
    assert result.output is None and chunks
    per_item = {}
    for chunk in chunks:
        per_item.setdefault(chunk.item, []).append(chunk.pixels)
    joined = torch.cat([torch.cat(per_item[i], 2) for i in sorted(per_item)])
    assert torch.equal(joined, whole)
    if engine.spec.path == "generic":  # decoded whole: one chunk per item
        assert [c.frame for c in chunks] == [0, 0]


FLUX2 = BY_NAME["flux2"]


@pytest.fixture(scope="module")
def flux2():
    vae = build(FLUX2, seed=2)
    return vae, engine_for(vae, "flux2")


def pipeline_flux2_decode(vae, packed, height, width):
    """Flux2Pipeline's own code after denoising: unpack by position ids, BatchNorm statistics,
    unpatchify, vae.decode (each item alone)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    b, _, c = packed.shape
    h, w = 2 * (height // 16) // 2, 2 * (width // 16) // 2
    ids = Flux2Pipeline._prepare_latent_ids(torch.empty(b, c, h, w))
    z = Flux2Pipeline._unpack_latents_with_ids(packed, ids)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
    z = Flux2Pipeline._unpatchify_latents(z * std + mean)
    with torch.inference_mode(), torch_threads(1):
        return torch.cat([vae.decode(item, return_dict=False)[0] for item in z.split(1)])


@pytest.mark.parametrize("height, width", [(48, 80), (32, 32), (63, 97)])
def test_flux2_packed_latents_decode_as_the_pipeline_does(flux2, height, width):
    vae, engine = flux2
    tokens = (height // 16) * (width // 16)
    packed = torch.randn(2, tokens, 32, generator=torch.Generator().manual_seed(height))
    expected = pipeline_flux2_decode(vae, packed, height, width)
    result = decode(engine, packed, height=height, width=width)
    assert torch.equal(result.output, expected)
    # the same latents patchified [B, 128, h, w], as the transformer sees them
    patchified = packed.transpose(1, 2).reshape(2, 32, height // 16, width // 16)
    assert torch.equal(decode(engine, patchified).output, expected)
    high = decode(engine, packed, height=height, width=width, quality="high")
    assert high.quality == "high" and (high.output - expected).abs().max() < 1e-3


def test_flux2_raw_latents_are_decoded_as_sent_and_factors_replace_the_statistics(flux2):
    vae, engine = flux2
    raw = torch.randn(2, 8, 5, 7, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode(), torch_threads(1):
        expected = torch.cat([vae.decode(item).sample for item in raw.split(1)])
        scaled = torch.cat([vae.decode(item / 2.0 + 0.5).sample for item in raw.split(1)])
    assert torch.equal(decode(engine, raw).output, expected)
    assert torch.equal(decode(engine, raw, scaling_factor=2.0, shift_factor=0.5).output, scaled)
    with pytest.raises(InvalidInput, match=r"takes \[B, 8, H, W\] or patchified \[B, 32, h, w\]") as err:
        engine.prepare(DecodeRequest(torch.randn(1, 12, 4, 4)))
    assert err.value.field == "latents"
    with pytest.raises(InvalidInput, match="packed latents need last dim 32") as err:
        engine.prepare(DecodeRequest(torch.randn(1, 6, 8), height=32, width=48))
    assert err.value.field == "latents"


QWEN = BY_NAME["qwen-image"]


@pytest.mark.parametrize("height, width", [(48, 80), (64, 32)])
def test_qwen_image_packed_latents_decode_as_the_pipeline_does(height, width):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    vae = build(QWEN, seed=1)
    engine = engine_for(vae, "qwen")
    tokens = (height // 16) * (width // 16)
    packed = torch.randn(2, tokens, 16, generator=torch.Generator().manual_seed(width))
    z = QwenImagePipeline._unpack_latents(packed, height, width, 8)  # [B, 4, 1, h, w]
    with torch_threads(1):
        expected = decode_alone(vae, QWEN, z[:, :, 0].unsqueeze(2))
    assert expected.dim() == 4  # images: the pipeline's [:, :, 0]
    result = decode(engine, packed, height=height, width=width)
    assert torch.equal(result.output, expected)
    assert torch.equal(decode(engine, z).output, expected)  # [B, C, 1, h, w]
    assert torch.equal(decode(engine, z[:, :, 0]).output, expected)  # [B, C, h, w]
    pngs = engine.encode(
        engine.decode([engine.prepare(DecodeRequest(packed, height=height, width=width, output="png"))])[0]
    )
    assert len(pngs.output) == 2 and pngs.output[0][:4] == b"\x89PNG"
    with pytest.raises(InvalidInput, match="decodes images: one latent frame") as err:
        engine.prepare(DecodeRequest(torch.randn(1, 4, 2, 3, 3)))
    assert err.value.field == "latents"
    with pytest.raises(InvalidInput) as err:
        engine.prepare(DecodeRequest(z, stream=True))
    assert err.value.field == "stream"


LTX = BY_NAME["ltx-video-timestep"]


@pytest.mark.parametrize("timestep", [None, 0.0, 0.05, 1.0])
def test_decode_timestep_reaches_timestep_conditioned_decoders(timestep):
    vae = build(LTX, seed=3)
    engine = engine_for(vae, "ltx")
    z = latents(LTX, batch=2, seed=6)
    with torch_threads(1):
        expected = decode_alone(vae, replace(LTX, timestep=timestep), z)
    assert torch.equal(decode(engine, z, decode_timestep=timestep).output, expected)
    assert engine.describe()["decode_timestep_default"] == 0.0


def test_decode_timesteps_never_share_a_decode():
    engine = engine_for(build(LTX, seed=3), "ltx")
    z = latents(LTX, batch=1)
    keys = {engine.prepare(DecodeRequest(z, decode_timestep=t)).batch_key for t in (None, 0.0, 0.05)}
    assert len(keys) == 2  # absent is the default 0.0


def test_decode_timestep_on_a_decoder_without_one_names_the_field():
    engine = engine_for(build(BY_NAME["ltx-video"]), "ltx")
    with pytest.raises(InvalidInput, match="not timestep-conditioned") as err:
        engine.prepare(DecodeRequest(latents(BY_NAME["ltx-video"], batch=1), decode_timestep=0.05))
    assert err.value.field == "decode_timestep"
    with pytest.raises(InvalidInput) as err:
        DecodeRequest(torch.zeros(1, 8, 1, 2, 2), decode_timestep=float("nan"))
    assert err.value.field == "decode_timestep"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("name", ["ltx-video", "mochi", "wan2.2", "hunyuan-video"])
def test_lossless_in_bf16_normalises_in_the_pipelines_dtype(name, dtype):
    """LTX and Mochi normalise fp32 latents and cast for the decoder afterwards; Wan and
    HunyuanVideo cast first and normalise in the decode dtype."""
    case = BY_NAME[name]
    vae = build(case).to(dtype)
    engine = engine_for(build(case), name, decode_precision="bf16")
    z = latents(case, batch=1, seed=7)
    first = z.to(dtype) if name in ("wan2.2", "hunyuan-video") else z
    normalised = case.normalise(vae, first).to(dtype)
    with torch_threads(1):
        expected = decode_alone(vae, replace(case, normalise=lambda vae, z: z), normalised)
    result = decode(engine, z)
    assert result.precision == "bf16" and torch.equal(result.output, expected)


def test_imagenet_normalised_pixels_become_uint8_as_their_pipeline_maps_them():
    """MiniMax-H3's decoder outputs ImageNet-normalised pixels; its pipeline maps them back with
    ImageNet's mean and std and clamps to [0, 1]: uint8 follows that, `float` stays the decoder's."""
    case = BY_NAME["minimax-h3"]
    engine = engine_for(build(case), case.name)
    z = latents(case, batch=1, seed=8)
    raw = decode(engine, z).output  # [B, 3, T, H, W] float
    with torch_threads(1):
        (pixels,) = engine.decode([engine.prepare(DecodeRequest(z))])
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1, 1)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1, 1)
    expected = ((raw.float() * std + mean).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
    assert pixels.output.dtype == torch.uint8 and torch.equal(pixels.output, expected)
    assert engine.describe()["pixels"] == "imagenet"
