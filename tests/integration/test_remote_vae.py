"""`vae_service_client.diffusers.RemoteVae` as a diffusers pipeline's `vae=`: real pipeline classes
built from tiny components run end to end against the running service and give the images and
frames the local VAE gives, bit for bit; tiling follows the local VAE's `enable_tiling()`; the
docs' weight-free example runs as written."""

import copy
import warnings

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
    WanPipeline,
    WanTransformer3DModel,
)

from tests.models import torch_threads
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service_client import PayloadTooLarge, VaeClient
from vae_service_client.diffusers import RemoteVae

pytestmark = pytest.mark.integration


def sd_pipeline(vae):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, norm_num_groups=4, attention_head_dim=4,
    )  # fmt: skip
    return StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=DDIMScheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def wan_pipeline(vae):
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=16, num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )  # fmt: skip
    return WanPipeline(
        tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )  # fmt: skip


def generate(pipe, **kwargs):
    """The prompt given as embeddings (no text encoder in these tiny pipelines), one thread as the
    service's replicas decode."""
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(4))
    with torch_threads(1):
        return pipe(prompt_embeds=embeds, num_inference_steps=2, guidance_scale=1.0, output_type="pt",
                    generator=g, **kwargs)  # fmt: skip


def test_an_image_pipeline_gives_the_local_vaes_images(kl_url, kl_reference):
    remote = RemoteVae(kl_url)
    assert remote.config.scaling_factor == kl_reference.config.scaling_factor
    assert remote.config.block_out_channels == list(kl_reference.config.block_out_channels)
    assert remote.dtype == torch.float32 and remote.device == torch.device("cpu")
    local = generate(sd_pipeline(kl_reference), height=40, width=24).images
    served = generate(sd_pipeline(remote), height=40, width=24).images
    assert served.shape == local.shape == (1, 3, 40, 24) and torch.equal(served, local)


def test_wan_pipeline_gives_the_local_vaes_frames(wan_url, wan_reference):
    remote = RemoteVae(wan_url)
    assert list(remote.config.latents_mean) == list(wan_reference.config.latents_mean)
    local = generate(wan_pipeline(wan_reference), height=16, width=32, num_frames=9).frames
    served = generate(wan_pipeline(remote), height=16, width=32, num_frames=9).frames
    assert served.shape == local.shape == (1, 9, 3, 16, 32) and torch.equal(served, local)


def test_a_routing_ingress_needs_the_model_and_encode_says_what_to_do(multi_url, flux_reference):
    with pytest.raises(ValueError, match=r"model: None is not served.*'flux', 'kl', 'wan'"):
        RemoteVae(multi_url)
    remote = RemoteVae(multi_url, model="flux")
    assert remote.config.shift_factor == flux_reference.config.shift_factor
    z = torch.randn(2, 8, 3, 5, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode(), torch_threads(1):
        expected = torch.cat([flux_reference.decode(item).sample for item in z.split(1)])
    out = remote.decode(z, return_dict=False)[0]
    assert torch.equal(out, expected) and torch.equal(remote.decode(z).sample, expected)
    with pytest.raises(NotImplementedError, match=r"decodes only.*encode with a local VAE"):
        remote.encode(torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"dtype: the service decodes in torch\.float32"):
        remote.to(torch.bfloat16)


def _local_decode(vae, z, tiling: bool):
    vae = copy.deepcopy(vae)  # the session's model stays as the other tests use it
    if tiling:
        vae.enable_tiling()
    with torch.inference_mode(), torch_threads(1):
        return torch.cat([vae.decode(item).sample for item in z.split(1)])


def test_tiled_answers_follow_enable_tiling_bit_for_bit_and_no_warning(kl_url, kl_vae):
    """Before: enable_tiling() did nothing, and the server chose by its own bound. Now the local
    VAE's switch decides: off, the plain decode; on, `vae.enable_tiling(); vae.decode`."""
    z = torch.randn(2, 4, 24, 20, generator=torch.Generator().manual_seed(9))
    untiled, tiled = _local_decode(kl_vae, z, False), _local_decode(kl_vae, z, True)
    assert not torch.equal(untiled, tiled)
    remote = RemoteVae(kl_url)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before: torch's "The given NumPy array is not writable"
        assert torch.equal(remote.decode(z).sample, untiled)
        remote.enable_tiling()
        assert remote.use_tiling and torch.equal(remote.decode(z).sample, tiled)
        remote.disable_tiling()
        assert torch.equal(remote.decode(z).sample, untiled)
    with pytest.raises(ValueError, match="the served model's own tile sizes"):
        remote.enable_tiling(tile_sample_min_size=256)


def test_without_tiling_a_decode_over_the_servers_bound_raises_instead_of_answering_tiled(app, kl_dir, kl_vae):
    z = torch.randn(1, 4, 24, 20, generator=torch.Generator().manual_seed(10))
    engine = DecodeEngine(ServiceConfig(model=str(kl_dir), device="cpu", cpu_threads=1))
    whole = engine.peak_bytes(engine.prepare(DecodeRequest(z, output="float", latents_scaled=True)))
    url = app("kl-bound", limits={"max_decode_bytes": whole - 1})
    with VaeClient(url) as client:  # a plain client (`tiling: auto`): the server tiles it, and says so
        assert client.decode(z, output="float", scaling_factor=None).tiled
    remote = RemoteVae(url)
    with pytest.raises(PayloadTooLarge) as err:
        remote.decode(z)
    assert err.value.field == "tiling" and "'none': decoding these latents whole needs" in err.value.message
    remote.enable_tiling()
    assert torch.equal(remote.decode(z).sample, _local_decode(kl_vae, z, True))
