"""Architecture presets: the public diffusers configs of the VAEs we serve, as data.

A preset carries architecture and latent scaling only. Served from a preset, weights are seeded
random numbers: the service then decodes noise, which is only good for demos and benchmarks.
Where a class's diffusers defaults are its published model's config (FLUX.2, Qwen-Image,
HunyuanVideo, LTX-Video, CogVideoX, Mochi, Cosmos), the preset is those defaults; the `tiny-*`
presets keep each architecture's layout (scales, block kinds) at a few channels, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_SD_BLOCKS = dict(
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2,
    norm_num_groups=32,
    act_fn="silu",
    in_channels=3,
    out_channels=3,
)

# Wan2.1's published per-channel latent statistics (diffusers' AutoencoderKLWan defaults).
WAN21_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
WAN21_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip


# Wan2.2-TI2V-5B's published per-channel latent statistics (its vae/config.json).
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip
_WAN22 = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    is_residual=True,
    patch_size=2,
    in_channels=12,
    out_channels=12,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
)
_TINY_WAN = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[-0.5, 0.25, 0.1, 0.9],
    latents_std=[2.0, 1.5, 1.25, 2.5],
)
_TINY_KL_BLOCKS = dict(
    block_out_channels=[16, 32, 32, 32],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=64,
)


@dataclass(frozen=True)
class Preset:
    name: str
    class_name: str
    config: dict = field(hash=False)
    description: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "sd",
            "AutoencoderKL",
            dict(_SD_BLOCKS, latent_channels=4, sample_size=512, scaling_factor=0.18215),
            "Stable Diffusion 1.x/2.x VAE (4 latent channels, 8x)",
        ),
        Preset(
            "sdxl",
            "AutoencoderKL",
            dict(_SD_BLOCKS, latent_channels=4, sample_size=1024, scaling_factor=0.13025),
            "SDXL VAE (4 latent channels, 8x)",
        ),
        Preset(
            "flux",
            "AutoencoderKL",
            dict(
                _SD_BLOCKS,
                latent_channels=16,
                sample_size=1024,
                scaling_factor=0.3611,
                shift_factor=0.1159,
                use_quant_conv=False,
                use_post_quant_conv=False,
            ),
            "FLUX.1 VAE (16 latent channels, 8x, no quant convs)",
        ),
        Preset(
            "flux2",
            "AutoencoderKLFlux2",
            {},
            "FLUX.2 VAE (32 latent channels, 8x; the denoiser's latents 2x2-patchified, BatchNorm-normalised)",
        ),
        Preset(
            "qwen-image",
            "AutoencoderKLQwenImage",
            {},
            "Qwen-Image VAE (a Wan-style causal video decoder, 16 latent channels, one frame: images)",
        ),
        Preset(
            "wan2.1",
            "AutoencoderKLWan",
            dict(
                base_dim=96,
                z_dim=16,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=2,
                attn_scales=[],
                temperal_downsample=[False, True, True],
                latents_mean=WAN21_LATENTS_MEAN,
                latents_std=WAN21_LATENTS_STD,
            ),
            "Wan2.1 video VAE (16 latent channels, 8x spatial, 4x temporal)",
        ),
        Preset(
            "wan2.2",
            "AutoencoderKLWan",
            _WAN22,
            "Wan2.2-TI2V-5B video VAE (48 latent channels, 16x spatial with a 2x2-patchified output, 4x temporal)",
        ),
        Preset(
            "hunyuan-video",
            "AutoencoderKLHunyuanVideo",
            {},
            "HunyuanVideo VAE (16 latent channels, 8x spatial, 4x temporal)",
        ),
        Preset(
            "hunyuan-video-1.5",
            "AutoencoderKLHunyuanVideo15",
            {},
            "HunyuanVideo 1.5 VAE (32 latent channels, 16x spatial, 4x temporal)",
        ),
        Preset(
            "ltx-video",
            "AutoencoderKLLTXVideo",
            {},
            "LTX-Video 0.9.0 VAE (128 latent channels, 32x spatial, 8x temporal)",
        ),
        Preset(
            "ltx-2",
            "AutoencoderKLLTX2Video",
            {"spatial_compression_ratio": 32, "temporal_compression_ratio": 8},
            "LTX-2 video VAE (128 latent channels, 32x spatial, 8x temporal)",
        ),
        Preset(
            "cogvideox",
            "AutoencoderKLCogVideoX",
            {},
            "CogVideoX VAE (16 latent channels, 8x spatial, 4x temporal)",
        ),
        Preset("mochi", "AutoencoderKLMochi", {}, "Mochi VAE (12 latent channels, 8x spatial, 6x temporal)"),
        Preset(
            "sana",
            "AutoencoderDC",
            {"scaling_factor": 0.41407},
            "SANA's DC-AE (32 latent channels, 32x)",
        ),
        Preset(
            "cosmos",
            "AutoencoderKLCosmos",
            {},
            "Cosmos 1 video VAE (16 latent channels, 8x spatial, 8x temporal)",
        ),
        Preset(
            "tiny-kl",
            "AutoencoderKL",
            dict(_TINY_KL_BLOCKS, latent_channels=4, scaling_factor=0.18215),
            "tiny AutoencoderKL with SD's layout (8x) for tests and demos",
        ),
        Preset(
            "tiny-flux2",
            "AutoencoderKLFlux2",
            dict(_TINY_KL_BLOCKS, latent_channels=8),
            "tiny AutoencoderKLFlux2 (8x, 2x2-patchified BatchNorm-normalised latents) for tests and demos",
        ),
        Preset(
            "tiny-wan",
            "AutoencoderKLWan",
            _TINY_WAN,
            "tiny AutoencoderKLWan (8x spatial, 4x temporal) for tests and demos",
        ),
        Preset(
            "tiny-wan2.2",
            "AutoencoderKLWan",
            dict(
                _WAN22,
                base_dim=8,
                decoder_base_dim=12,
                z_dim=8,
                dim_mult=[1, 2, 2, 2],
                num_res_blocks=1,
                latents_mean=WAN22_LATENTS_MEAN[:8],
                latents_std=WAN22_LATENTS_STD[:8],
            ),
            "tiny Wan2.2-style AutoencoderKLWan (residual up blocks, 16x with a patchified output) for tests",
        ),
        Preset(
            "tiny-qwen-image",
            "AutoencoderKLQwenImage",
            _TINY_WAN,
            "tiny AutoencoderKLQwenImage (8x, one frame) for tests and demos",
        ),
        Preset(
            "tiny-ltx-video",
            "AutoencoderKLLTXVideo",
            dict(
                latent_channels=8,
                block_out_channels=[8, 16, 16, 16],
                decoder_block_out_channels=[8, 16, 32],
                layers_per_block=[1, 1, 1, 1, 1],
                decoder_layers_per_block=[1, 1, 1, 1],
                spatio_temporal_scaling=[True, True, True, False],
                decoder_spatio_temporal_scaling=[True, True, True],
                decoder_inject_noise=[False, False, False, False],
                upsample_residual=[True, True, True],
                upsample_factor=[2, 2, 2],
                timestep_conditioning=True,
                patch_size=4,
                patch_size_t=1,
            ),
            "tiny timestep-conditioned AutoencoderKLLTXVideo (32x spatial, 8x temporal) for tests and demos",
        ),
        Preset(
            "tiny-hunyuan-video",
            "AutoencoderKLHunyuanVideo",
            dict(block_out_channels=[8, 16, 16, 16], layers_per_block=1, norm_num_groups=4, latent_channels=4),
            "tiny AutoencoderKLHunyuanVideo (8x spatial, 4x temporal) for tests and demos",
        ),
    ]
}
