"""Tiny real diffusers autoencoders of every class the service names, several configs per class,
each with the latent normalisation its pipeline applies before `vae.decode`, written from the
pipelines' own code (their static helpers where they have them) and not from the service's.

Weights are diffusers' initialisation with norms, BatchNorm statistics and latent-statistic
buffers moved away from identity, so that a wrong statistic or op order shows in the output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import diffusers
import torch

from vae_service.models.presets import PRESETS

_KL_BLOCKS = dict(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, sample_size=64)


def _wan_stats(config: dict) -> Callable:
    def normalise(vae, z):  # WanPipeline / QwenImagePipeline: the reciprocal of the cast std
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        return z / std + mean

    return normalise


def _divide(vae, z):  # SD, HunyuanVideo, SANA: latents / scaling_factor
    return z / vae.config.scaling_factor


def _sdxl_stats(vae, z):  # StableDiffusionXLPipeline with a config that carries latents_mean/std
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1).to(z.device, z.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1).to(z.device, z.dtype)
    return z * std / vae.config.scaling_factor + mean


def _reciprocal(vae, z):  # CogVideoX: 1 / scaling_factor * latents
    return 1 / vae.config.scaling_factor * z


def _ltx(vae, z):
    from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline

    out = LTXPipeline._denormalize_latents(z.float(), vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    return out.to(z.dtype)


def _ltx2(vae, z):
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    return LTX2Pipeline._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def _mochi(vae, z):  # MochiPipeline, in fp32
    c = vae.config.latent_channels
    x = z.float()
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(x.device, x.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(x.device, x.dtype)
    return (x * std / vae.config.scaling_factor + mean).to(z.dtype)


def _cosmos(vae, z):  # CosmosTextToWorldPipeline: per channel and latent frame, over sigma_data 0.5
    c, x = vae.config.latent_channels, z.float()
    mean = torch.tensor(vae.config.latents_mean).view(1, c, -1, 1, 1)[:, :, : x.size(2)].to(x)
    std = torch.tensor(vae.config.latents_std).view(1, c, -1, 1, 1)[:, :, : x.size(2)].to(x)
    return (x * std / 0.5 + mean).to(z.dtype)


def _minimax(vae, z):  # MiniMax-H3's modular decoder: fp32 statistics
    x = z.float()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (x * std + mean).to(z.dtype)


def _flux2(vae, z):
    """Flux2Pipeline on its patchified denoiser latents [B, 128, h, w]: BatchNorm statistics, then
    unpatchify (raw [B, 32, H, W] latents are not normalised)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    if z.shape[1] == vae.config.latent_channels:
        return z
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
    return Flux2Pipeline._unpatchify_latents(z * std + mean)


def _none(vae, z):
    return z


@dataclass(frozen=True)
class Case:
    name: str
    cls: str
    config: dict
    latent: tuple[int, ...]  # one item, decoder layout (FLUX.2: patchified)
    normalise: Callable = _none  # its pipeline's, on latents as the denoiser hands them over
    timestep: float | None = None  # a decode timestep to send (timestep-conditioned decoders)
    tags: tuple[str, ...] = field(default=())

    @property
    def video(self) -> bool:
        return len(self.latent) == 4 and self.cls != "AutoencoderKLQwenImage"


CASES = [
    Case("sdxl-stats", "AutoencoderKL", dict(_KL_BLOCKS, block_out_channels=[8, 16, 16, 16], layers_per_block=1,
         norm_num_groups=4, latent_channels=4, scaling_factor=0.5, latents_mean=[0.1, -0.2, 0.3, 0.0],
         latents_std=[1.5, 0.5, 2.0, 1.0]), (4, 3, 5), _sdxl_stats),
    Case("flux2", "AutoencoderKLFlux2", dict(_KL_BLOCKS, block_out_channels=[8, 16, 16, 16], layers_per_block=1,
         norm_num_groups=4, latent_channels=8), (32, 3, 5), _flux2),
    Case("flux2-wide", "AutoencoderKLFlux2", dict(_KL_BLOCKS, block_out_channels=[16, 32, 32, 32], layers_per_block=1,
         norm_num_groups=8, latent_channels=4, use_post_quant_conv=False), (16, 2, 4), _flux2),
    Case("qwen-image", "AutoencoderKLQwenImage", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
         attn_scales=[], temperal_downsample=[False, True, True], latents_mean=[-0.5, 0.25, 0.1, 0.9],
         latents_std=[2.0, 1.5, 1.25, 2.5]), (4, 1, 3, 5), _wan_stats({})),
    Case("qwen-image-6", "AutoencoderKLQwenImage", dict(base_dim=8, z_dim=6, dim_mult=[1, 2, 2], num_res_blocks=2,
         attn_scales=[0.5], temperal_downsample=[False, True], latents_mean=[0.2] * 6,
         latents_std=[0.5, 1, 2, 3, 4, 5]), (6, 1, 5, 3), _wan_stats({})),
    Case("wan2.2", "AutoencoderKLWan", dict(base_dim=8, decoder_base_dim=12, z_dim=8, dim_mult=[1, 2, 2, 2],
         num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12,
         out_channels=12, scale_factor_spatial=16, latents_mean=[0.1] * 8, latents_std=[1.5] * 8),
         (8, 3, 3, 5), _wan_stats({})),
    Case("hunyuan-video", "AutoencoderKLHunyuanVideo", dict(block_out_channels=[8, 16, 16, 16], layers_per_block=1,
         norm_num_groups=4, latent_channels=4), (4, 2, 3, 5), _divide),
    Case("hunyuan-video-tiled", "AutoencoderKLHunyuanVideo", dict(block_out_channels=[8, 8, 8, 8], layers_per_block=1,
         norm_num_groups=4, latent_channels=4, scaling_factor=0.5), (4, 6, 2, 3), _divide),  # framewise tiles
    Case("hunyuan-video-1.5", "AutoencoderKLHunyuanVideo15", dict(block_out_channels=[8, 8, 16, 16, 16],
         layers_per_block=1, latent_channels=4), (4, 2, 3, 5), _divide),
    Case("ltx-video", "AutoencoderKLLTXVideo", dict(latent_channels=8, block_out_channels=[8, 16, 16, 16],
         decoder_block_out_channels=[8, 16, 16, 16], layers_per_block=[1, 1, 1, 1, 1],
         decoder_layers_per_block=[1, 1, 1, 1, 1], spatio_temporal_scaling=[True, True, True, False],
         decoder_spatio_temporal_scaling=[True, True, True, False], decoder_inject_noise=[False] * 5,
         upsample_residual=[False] * 4, upsample_factor=[1] * 4, timestep_conditioning=False, patch_size=4,
         patch_size_t=1, scaling_factor=0.5), (8, 2, 3, 5), _ltx),
    Case("ltx-video-timestep", "AutoencoderKLLTXVideo", dict(PRESETS["tiny-ltx-video"].config, scaling_factor=0.75),
         (8, 2, 1, 3), _ltx, timestep=0.05),
    Case("ltx-2", "AutoencoderKLLTX2Video", dict(latent_channels=8, block_out_channels=[8, 16, 16, 16],
         decoder_block_out_channels=[8, 16, 32], layers_per_block=[1, 1, 1, 1, 1],
         decoder_layers_per_block=[1, 1, 1, 1], patch_size=4, patch_size_t=1, spatial_compression_ratio=32,
         temporal_compression_ratio=8), (8, 2, 2, 3), _ltx2),
    Case("cogvideox", "AutoencoderKLCogVideoX", dict(block_out_channels=[8, 16, 16, 16], latent_channels=4,
         layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4, sample_height=64, sample_width=96),
         (4, 3, 3, 5), _reciprocal),
    Case("cogvideox-even", "AutoencoderKLCogVideoX", dict(block_out_channels=[8, 8, 16, 16], latent_channels=4,
         layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4, sample_height=64, sample_width=96),
         (4, 2, 2, 3), _reciprocal),
    Case("mochi", "AutoencoderKLMochi", dict(encoder_block_out_channels=[32, 32, 32, 32],
         decoder_block_out_channels=[32, 32, 32, 64], latent_channels=4, layers_per_block=[1, 1, 1, 1, 1],
         latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0]), (4, 2, 3, 5), _mochi),
    Case("sana", "AutoencoderDC", dict(latent_channels=8, attention_head_dim=8,
         encoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
         decoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
         encoder_block_out_channels=[8, 8, 16, 16, 16, 16], decoder_block_out_channels=[8, 8, 16, 16, 16, 16],
         encoder_layers_per_block=[1] * 6, decoder_layers_per_block=[1] * 6,
         encoder_qkv_multiscales=[[], [], [], [5], [5], [5]], decoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
         upsample_block_type="interpolate", downsample_block_type="Conv",
         decoder_norm_types=["batch_norm"] * 3 + ["rms_norm"] * 3, decoder_act_fns=["relu"] * 3 + ["silu"] * 3,
         scaling_factor=0.41407), (8, 3, 2), _divide),
    Case("cosmos", "AutoencoderKLCosmos", dict(latent_channels=4, encoder_block_out_channels=[8, 8, 8, 8],
         decode_block_out_channels=[8, 8, 8, 8], attention_resolutions=[32], resolution=1024, num_layers=1,
         patch_size=4, patch_type="haar", spatial_compression_ratio=8, temporal_compression_ratio=8,
         latents_mean=[0.01 * i for i in range(4 * 3)], latents_std=[1 + 0.1 * i for i in range(4 * 3)]),
         (4, 2, 3, 5), _cosmos),
    Case("minimax-h3", "AutoencoderKLMiniMaxH3", dict(latent_channels=4, block_out_channels=[8] * 6,
         layers_per_block=1, norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
         decoder_attention_head_dim=8, decoder_num_register_tokens=4, decoder_ffn_mult=1,
         latents_mean=[0.1, 0.0, -0.1, 0.2], latents_std=[1.0, 2.0, 0.5, 1.5]), (4, 3, 3, 5), _minimax),
    # not named in the service's table: served on the generic path with no normalisation
    Case("kvae", "AutoencoderKLKVAE", dict(channels=32, num_enc_blocks=1, num_dec_blocks=1, z_channels=4,
         ch_mult=[1, 1, 1, 2], sample_size=64), (4, 3, 5), tags=("unnamed",)),
    Case("kvae-video", "AutoencoderKLKVAEVideo", dict(ch=32, ch_mult=[1, 1, 1, 2], num_res_blocks=1, z_channels=4,
         temporal_compress_times=4), (4, 2, 3, 5), tags=("unnamed",)),
]  # fmt: skip
BY_NAME = {c.name: c for c in CASES}


def build(case: Case, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    vae = getattr(diffusers, case.cls)(**case.config).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name or "gamma" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in vae.named_buffers():
            if name.endswith(("running_mean", "latents_mean")):
                b.copy_(0.2 * torch.randn_like(b))
            elif name.endswith(("running_var", "latents_std")):
                b.copy_(0.5 + torch.rand_like(b))
    return vae


def latents(case: Case, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, *case.latent, generator=torch.Generator().manual_seed(seed))


def decode_alone(vae, case: Case, z: torch.Tensor) -> torch.Tensor:
    """The pipeline's normalisation, then `vae.decode` of each item alone: the lossless contract."""
    x = case.normalise(vae, z)
    with torch.inference_mode():
        outs = []
        for item in x.split(1):
            if getattr(vae.decoder, "time_embedder", None) is not None:
                t = torch.tensor([0.0 if case.timestep is None else case.timestep], dtype=item.dtype)
                outs.append(vae.decode(item, temb=t).sample)
            else:
                outs.append(vae.decode(item).sample)
    out = torch.cat(outs)
    return out[:, :, 0] if case.cls == "AutoencoderKLQwenImage" else out
