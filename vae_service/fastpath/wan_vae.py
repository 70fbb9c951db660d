"""Fast forwards for diffusers' Wan-style causal decoders: AutoencoderKLWan (Wan2.1, and Wan2.2's
residual up blocks with a patchified output) and AutoencoderKLQwenImage (the same modules under
Qwen-Image's names).

Every RMSNorm in the decoder's residual blocks and output head is immediately followed by that
block's own SiLU instance and nothing else uses it, so while the gate is on (`rms_norm_silu`) the
norm computes RMSNorm+SiLU in one op and the SiLU passes through: the blocks' feature-cache logic
stays diffusers' own. With `channels_last_3d`, activations are channels-last-3d while fast.
"""

from __future__ import annotations

import torch
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

from vae_service.fastpath.fused_norms import WanRMSNormSiLU
from vae_service.fastpath.patching import Patch
from vae_service.fastpath.rewrites import RewritePlan
from vae_service.fastpath.structure import exact_type, plain_silu, unknown_modules
from vae_service.fastpath.wan_chunks import WalkOptions

DECODERS = (wan.WanDecoder3d, qwen.QwenImageDecoder3d)
RESIDUAL_BLOCKS = (wan.WanResidualBlock, qwen.QwenImageResidualBlock)
RMS_NORMS = (wan.WanRMS_norm, qwen.QwenImageRMS_norm)
_ALLOWED = {
    *DECODERS,
    *RESIDUAL_BLOCKS,
    *RMS_NORMS,
    wan.WanMidBlock,
    wan.WanUpBlock,
    wan.WanResidualUpBlock,
    wan.DupUp3D,
    wan.WanAttentionBlock,
    wan.WanResample,
    wan.WanUpsample,
    wan.WanCausalConv3d,
    qwen.QwenImageMidBlock,
    qwen.QwenImageUpBlock,
    qwen.QwenImageAttentionBlock,
    qwen.QwenImageResample,
    qwen.QwenImageUpsample,
    qwen.QwenImageCausalConv3d,
    nn.ModuleList,
    nn.Sequential,
    nn.SiLU,
    nn.Dropout,
    nn.Conv2d,
    nn.Identity,
}


def _channel_first_rms(norm: nn.Module) -> bool:
    return exact_type(norm, RMS_NORMS) and norm.channel_first


def check_wan_decoder(decoder: nn.Module) -> list[str]:
    if not exact_type(decoder, DECODERS):
        return [f"decoder is {type(decoder).__name__}, not diffusers' WanDecoder3d or QwenImageDecoder3d"]
    reasons = [f"unknown module {u}" for u in unknown_modules(decoder, _ALLOWED)]
    if not (_channel_first_rms(decoder.norm_out) and plain_silu(decoder.nonlinearity)):
        reasons.append("output head is not channel-first RMSNorm + SiLU")
    for name, m in decoder.named_modules():
        if exact_type(m, RESIDUAL_BLOCKS) and not (
            _channel_first_rms(m.norm1) and _channel_first_rms(m.norm2) and plain_silu(m.nonlinearity)
        ):
            reasons.append(f"residual block {name} is not channel-first RMSNorm + SiLU")
    return reasons


def _fused(norm: nn.Module, op):
    return lambda x: op(x, norm)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _fast_decoder(d: nn.Module):
    reference = d.forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return reference(x.contiguous(memory_format=torch.channels_last_3d), *args, **kwargs).contiguous()

    return forward


def wan_patches(vae: nn.Module, plan: RewritePlan) -> list[Patch]:
    decoder = vae.decoder
    patches = []
    if "rms_norm_silu" in plan:
        op = WanRMSNormSiLU.bind(plan.active["rms_norm_silu"])
        for m in decoder.modules():
            if exact_type(m, RESIDUAL_BLOCKS):
                patches += [
                    Patch(m.norm1, "forward", _fused(m.norm1, op)),
                    Patch(m.norm2, "forward", _fused(m.norm2, op)),
                    Patch(m.nonlinearity, "forward", _identity),
                ]
        patches += [
            Patch(decoder.norm_out, "forward", _fused(decoder.norm_out, op)),
            Patch(decoder.nonlinearity, "forward", _identity),
        ]
    if "channels_last_3d" in plan:
        patches.append(Patch(decoder, "forward", _fast_decoder(decoder)))
    return patches


def wan_walks(plan: RewritePlan) -> dict[str, WalkOptions | None]:
    """How each tier runs Wan chunks (wan_chunks.py): None = diffusers' own decoder forward (with
    the gated patches above in `high`)."""
    if "causal_cache" not in plan:
        return {"lossless": None, "high": None}
    fused = "rms_norm_silu" in plan and plan.active["rms_norm_silu"] != "torch"
    high = WalkOptions(
        norm_silu=WanRMSNormSiLU.bind(plan.active["rms_norm_silu"]) if fused else None,
        first_frame_2d="first_frame_2d" in plan,
        channels_last="channels_last_3d" in plan,
        conv_bias_fold=fused and "wan_conv_bias_fold" in plan,
    )
    return {"lossless": WalkOptions(), "high": high}
