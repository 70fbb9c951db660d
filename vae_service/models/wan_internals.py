"""Every diffusers internal the Wan decode reads, in one place: the module classes of Wan-style
causal decoders (AutoencoderKLWan: Wan2.1, Wan2.2; AutoencoderKLQwenImage), the frames a causal
conv's cache holds (`CACHE_T`), how a causal conv stores its padding (`_padding`), the decoder's
per-frame forward with its feature cache, Wan2.2's `unpatchify` and its shortcut's `first_chunk`.

The engine's walk (engine/runtime/wan_walk.py) calls these modules one by one; `walk_unsupported_because`
checks, on each loaded model, every assumption it makes about them. A diffusers release that
changes one makes the model load with diffusers' own per-frame forward (`diffusers_chunks`) in
both tiers, with the reason logged and shown in /health; it never decodes differently.
pyproject.toml bounds diffusers to the releases these were read from.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

from vae_service.models.structure import exact_type, plain_silu, unknown_modules

HISTORY = 2  # input frames a 3-tap causal conv sees before the current ones
# the video classes whose decoder the walk knows: what decode sessions decode (engine/execution/session.py)
SESSION_CLASSES = ("AutoencoderKLWan",)

DECODERS = (wan.WanDecoder3d, qwen.QwenImageDecoder3d)
RESIDUAL_BLOCKS = (wan.WanResidualBlock, qwen.QwenImageResidualBlock)
RMS_NORMS = (wan.WanRMS_norm, qwen.QwenImageRMS_norm)
CAUSAL_CONVS = (wan.WanCausalConv3d, qwen.QwenImageCausalConv3d)
_KNOWN = {
    *DECODERS,
    *RESIDUAL_BLOCKS,
    *RMS_NORMS,
    *CAUSAL_CONVS,
    wan.WanMidBlock,
    wan.WanUpBlock,
    wan.WanResidualUpBlock,
    wan.DupUp3D,
    wan.WanAttentionBlock,
    wan.WanResample,
    wan.WanUpsample,
    qwen.QwenImageMidBlock,
    qwen.QwenImageUpBlock,
    qwen.QwenImageAttentionBlock,
    qwen.QwenImageResample,
    qwen.QwenImageUpsample,
    nn.ModuleList,
    nn.Sequential,
    nn.SiLU,
    nn.Dropout,
    nn.Conv2d,
    nn.Identity,
}
_RESAMPLE_MODES = ("upsample2d", "upsample3d")


def spatial_padding(conv: nn.Module) -> tuple[int, int]:
    """(height, width) zero padding of a causal conv: diffusers keeps F.pad's order in `_padding`,
    (w, w, h, h, 2 x time, 0), and pads time on the left only."""
    return conv._padding[2], conv._padding[0]


def unpatchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    return wan.unpatchify(x, patch_size=patch_size)


def upsampler_of(block: nn.Module) -> nn.Module | None:
    """Wan2.1/Qwen-Image up blocks keep theirs in `upsamplers[0]`, Wan2.2's residual ones in `upsampler`."""
    if getattr(block, "upsamplers", None) is not None:
        return block.upsamplers[0]
    return getattr(block, "upsampler", None)


def _channel_first_rms(norm: nn.Module) -> bool:
    return exact_type(norm, RMS_NORMS) and norm.channel_first and hasattr(norm, "scale")


def _walked_convs(decoder: nn.Module) -> list[tuple[str, nn.Module]]:
    """The causal convs the walk feeds from its history buffers (every one but the 1x1x1 shortcuts,
    which run as diffusers' modules)."""
    return [
        (name, m)
        for name, m in decoder.named_modules()
        if exact_type(m, CAUSAL_CONVS) and not name.endswith("conv_shortcut")
    ]


def walk_unsupported_because(vae: nn.Module) -> list[str]:
    """Why the walk cannot decode this model (empty: it can, bit-identically to `vae.decode`)."""
    try:
        return _unsupported_because(vae)
    except (AttributeError, TypeError, IndexError) as exc:  # a module's attributes were renamed
        return [f"diffusers' Wan modules differ from what the walk reads: {type(exc).__name__}: {exc}"]


def _unsupported_because(vae: nn.Module) -> list[str]:
    decoder = getattr(vae, "decoder", None)
    if not exact_type(decoder, DECODERS):
        return [f"decoder is {type(decoder).__name__}, not diffusers' WanDecoder3d or QwenImageDecoder3d"]
    reasons = [f"unknown module {u}" for u in unknown_modules(decoder, _KNOWN)]
    if wan.CACHE_T != HISTORY or qwen.CACHE_T != HISTORY:
        reasons.append(f"diffusers caches {wan.CACHE_T} frames per causal conv, the walk {HISTORY}")
    if not (_channel_first_rms(decoder.norm_out) and plain_silu(decoder.nonlinearity)):
        reasons.append("output head is not channel-first RMSNorm + SiLU")
    for name, m in decoder.named_modules():
        if exact_type(m, RESIDUAL_BLOCKS) and not (
            _channel_first_rms(m.norm1) and _channel_first_rms(m.norm2) and plain_silu(m.nonlinearity)
        ):
            reasons.append(f"residual block {name} is not channel-first RMSNorm + SiLU")
        if isinstance(m, (wan.WanResample, qwen.QwenImageResample)) and m.mode not in _RESAMPLE_MODES:
            reasons.append(f"{name} resamples by {m.mode!r}")
        if isinstance(m, wan.DupUp3D) and "first_chunk" not in inspect.signature(type(m).forward).parameters:
            reasons.append(f"{name}'s forward takes no first_chunk")
    for name, conv in _walked_convs(decoder):
        p = tuple(getattr(conv, "_padding", ()))  # diffusers moved the conv's own padding here
        causal = len(p) == 6 and p[0] == p[1] and p[2] == p[3] and p[4:] == (HISTORY, 0)
        if not causal or conv.kernel_size[0] != HISTORY + 1 or conv.stride[0] != 1:
            reasons.append(f"causal conv {name} is not a 3-tap, stride-1 conv padded {HISTORY} frames on the left")
    return reasons


def diffusers_chunks(vae: nn.Module, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """`vae.decode(z).sample` one latent frame at a time through diffusers' own decoder forward,
    with a feature cache of one slot per causal conv as `_decode` sets it up (Wan's decoder also
    takes `first_chunk`; Qwen-Image's does not): one [B, 3, t, H, W] tensor per latent frame."""
    x = vae.post_quant_conv(z)
    decoder = vae.decoder
    cache: list = [None] * sum(isinstance(m, nn.Conv3d) and hasattr(m, "_padding") for m in decoder.modules())
    takes_first_chunk = "first_chunk" in inspect.signature(type(decoder).forward).parameters
    for i in range(x.shape[2]):
        extra = {"first_chunk": i == 0} if takes_first_chunk else {}
        yield finished_chunk(vae, decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], **extra))


def finished_chunk(vae: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """A decoder output chunk as `_decode` finishes the whole output: unpatchified (Wan2.2), clamped."""
    patch_size = getattr(vae.config, "patch_size", None)
    if patch_size is not None:
        out = unpatchify(out, patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)
