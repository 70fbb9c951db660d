"""Architecture presets: the public diffusers configs of the VAEs we serve, as data.

A preset carries architecture and latent scaling only. Served from a preset, weights are seeded
random numbers: the service then decodes noise, which is only good for demos and benchmarks.
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
            "tiny-kl",
            "AutoencoderKL",
            dict(
                block_out_channels=[16, 32, 32, 32],
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=1,
                norm_num_groups=8,
                latent_channels=4,
                sample_size=64,
                scaling_factor=0.18215,
            ),
            "tiny AutoencoderKL with SD's layout (8x) for tests and demos",
        ),
        Preset(
            "tiny-wan",
            "AutoencoderKLWan",
            dict(
                base_dim=8,
                z_dim=4,
                dim_mult=[1, 2, 2, 2],
                num_res_blocks=1,
                attn_scales=[],
                temperal_downsample=[False, True, True],
                latents_mean=[-0.5, 0.25, 0.1, 0.9],
                latents_std=[2.0, 1.5, 1.25, 2.5],
            ),
            "tiny AutoencoderKLWan (8x spatial, 4x temporal) for tests and demos",
        ),
    ]
}
