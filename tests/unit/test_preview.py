"""The `preview` tier: a linear latent-to-RGB map (fitted to the model, or configured) or a tiny
autoencoder; batched by tier like the others and never mixed; streamed per latent frame; answers
say `quality: "preview"`."""

import asyncio
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderTiny

from tests.models import torch_threads
from tests.zoo import BY_NAME, build, latents
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service.engine.media.frames import frame_counts
from vae_service.engine.runtime.preview import LinearPreview, fit_linear_preview
from vae_service.models import ModelLoadError
from vae_service.models.loading import LoadedVae
from vae_service.serving.decode_service import DecodeService

TINY_DECODER = dict(
    encoder_block_out_channels=[8, 8, 8, 8], decoder_block_out_channels=[8, 8, 8, 8],
    num_encoder_blocks=[1, 1, 1, 1], num_decoder_blocks=[1, 1, 1, 1], latent_channels=4,
)  # fmt: skip


def engine_for(vae, **config) -> DecodeEngine:
    return DecodeEngine(ServiceConfig(model="x", device="cpu", cpu_threads=1, **config), LoadedVae.of(vae))


def run(engine, z, **kw):
    with torch_threads(1):
        (result,) = engine.decode([engine.prepare(DecodeRequest(z, **kw))])
    return result


@pytest.mark.parametrize("name", ["flux2", "hunyuan-video", "qwen-image", "sana"])
def test_the_linear_preview_is_its_definition(name):
    """rgb = W z + b on the decoder's input latents, bilinear to the output size, one latent frame
    repeated over the frames it stands for; the full decode's shape; milliseconds, no VAE."""
    case = BY_NAME[name]
    engine = engine_for(build(case))
    z = latents(case, batch=2, seed=1)
    calls = []
    hook = engine.vae.register_forward_pre_hook(lambda *a: calls.append(1))
    preview = run(engine, z, quality="preview", output="float")
    hook.remove()
    full = run(engine, z, output="float")
    assert preview.quality == "preview" and preview.output.shape == full.output.shape and not calls
    linear = engine.preview.linear
    x = engine.runtime.scaling.to_decoder_input(engine.prepare(DecodeRequest(z)), engine.device)
    frames = x.unbind(2) if x.dim() == 5 else [x]
    expected = [
        F.interpolate(
            torch.einsum("nchw,cr->nrhw", f, linear.weight) + linear.bias.view(1, 3, 1, 1),
            scale_factor=engine.spec.spatial_scale,
            mode="bilinear",
        )
        for f in frames
    ]
    if x.dim() == 5 and engine.video:
        law = engine.spec.geometry.frames.law
        counts = frame_counts(full.output.shape[2], len(frames), law)
        expected = torch.cat(
            [e.unsqueeze(2).expand(-1, -1, n, -1, -1) for e, n in zip(expected, counts, strict=True)], 2
        )
    else:
        expected = expected[0]
    assert torch.allclose(preview.output, expected.reshape(preview.output.shape), atol=1e-6)


def test_the_fit_recovers_a_linear_decoder():
    """Fitted against a decoder that is itself linear per latent pixel, the map is that decoder (to
    the ridge's shrinkage, 1e-4 relative)."""
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(6, 3, generator=g), torch.randn(3, generator=g)

    def linear_decoder(z):
        rgb = torch.einsum("nchw,cr->nrhw", z, weight) + bias.view(1, 3, 1, 1)
        return F.interpolate(rgb, scale_factor=4, mode="nearest")

    fitted = fit_linear_preview(linear_decoder, torch.randn(2, 6, 8, 8, generator=g), lambda z: z * 2 + 1, 4)
    assert torch.allclose(fitted.weight, weight, rtol=1e-3, atol=1e-4)
    assert torch.allclose(fitted.bias, bias, rtol=1e-3, atol=1e-4)


def test_configured_factors_are_used_and_checked(kl_vae):
    factors = [[0.1 * i, 0.2, -0.1 * i] for i in range(4)]
    engine = engine_for(kl_vae, preview_rgb_factors=factors, preview_rgb_bias=[0.5, 0.0, -0.5])
    assert engine.describe()["preview"] == "linear (configured)"
    assert torch.equal(engine.preview.linear.weight, torch.tensor(factors))
    with pytest.raises(ModelLoadError, match="preview_rgb_factors: 3 rows for 4 latent channels"):
        engine_for(kl_vae, preview_rgb_factors=factors[:3])
    with pytest.raises(ValueError, match="preview_rgb_bias"):
        ServiceConfig(preview_rgb_bias=[1.0, 2.0])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(4)
    tiny = AutoencoderTiny(**TINY_DECODER).eval()
    folder = tmp_path_factory.mktemp("taesd")
    tiny.save_pretrained(folder)
    return folder, AutoencoderTiny.from_pretrained(folder).eval()  # as loaded: tests/models.py load_reference


def test_a_tiny_decoder_preview_is_its_own_decode(tiny_dir, kl_vae):
    folder, tiny = tiny_dir
    engine = engine_for(kl_vae, preview_decoder=str(folder))
    z = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(5))
    preview = run(engine, z, quality="preview", output="float")
    with torch.inference_mode(), torch_threads(1):  # DreamLitePipeline's: latents / scaling + shift
        expected = tiny.decode(z / tiny.config.scaling_factor + tiny.config.shift_factor).sample
    assert preview.quality == "preview" and torch.equal(preview.output, expected)
    assert engine.describe()["preview"] == "tiny decoder"


def test_a_video_models_tiny_decoder_previews_each_latent_frame(tiny_dir):
    folder, tiny = tiny_dir
    vae = build(BY_NAME["hunyuan-video"])
    engine = engine_for(vae, preview_decoder=str(folder))
    z = torch.randn(1, 4, 3, 2, 3, generator=torch.Generator().manual_seed(6))
    preview = run(engine, z, quality="preview", output="float").output  # [1, 3, 9, 16, 24]
    with torch.inference_mode(), torch_threads(1):
        frames = [tiny.decode(z[:, :, t] / 1.0 + 0.0).sample for t in range(3)]
    assert preview.shape[2] == 9
    for frame, t in zip(range(9), [0, 1, 1, 1, 1, 2, 2, 2, 2], strict=True):
        assert torch.equal(preview[:, :, frame], frames[t])


def test_a_tiny_decoder_for_other_latents_is_refused(tiny_dir):
    folder, _ = tiny_dir
    with pytest.raises(ModelLoadError, match="preview_decoder: decodes 4-channel image latents at 8x"):
        engine_for(build(BY_NAME["flux2"]), preview_decoder=str(folder))


def test_a_video_preview_streams_one_chunk_per_latent_frame():
    case = BY_NAME["wan2.2"]
    engine = engine_for(build(case))
    z = latents(case, batch=2, seed=7)
    whole = run(engine, z, quality="preview", output="float").output
    chunks = []
    with torch_threads(1):
        prepared = engine.prepare(DecodeRequest(z, quality="preview", output="float", stream=True))
        (result,) = engine.decode([replace(prepared, sink=chunks.append)])
    assert result.output is None and result.quality == "preview"
    assert [c.frame for c in chunks] == [0, 1, 5] and all(c.pixels.shape[0] == 2 for c in chunks)
    assert torch.equal(torch.cat([c.pixels for c in chunks], 2), whole)


def test_preview_never_shares_a_batch_with_decodes(kl_dir):
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl", device="cpu", cpu_threads=1))
    engine, seen = service.engine, []
    decode = engine.decode

    def observed(batch, *args, **kwargs):
        seen.append({r.request.quality for r in batch})
        return decode(batch, *args, **kwargs)

    engine.decode = observed
    z = torch.randn(1, 4, 3, 3)
    qualities = ["preview", "lossless", "high", "preview", "preview", "lossless", "high", "preview"]

    async def burst():
        return await asyncio.gather(*(service.decode(DecodeRequest(z, quality=q)) for q in qualities))

    results = asyncio.run(burst())
    assert [r.quality for r in results] == qualities
    assert all(len(tiers) == 1 for tiers in seen) and {"preview"} in seen
    keys = {engine.prepare(DecodeRequest(z, quality=q)).batch_key for q in ("preview", "lossless", "high")}
    assert len(keys) == 3
    mixed = [engine.prepare(DecodeRequest(z, quality=q)) for q in ("preview", "lossless")]
    with pytest.raises(ValueError, match="must share one"):
        decode(mixed)


def test_the_preview_map_on_its_own_device_is_the_same_map():
    linear = LinearPreview(torch.eye(3), torch.zeros(3), 2)
    z = torch.randn(1, 3, 2, 2)
    assert torch.equal(linear.to(torch.device("cpu")).image(z), F.interpolate(z, scale_factor=2, mode="bilinear"))
