"""Fast forwards for diffusers' AutoencoderKL decoder (SD, SDXL, FLUX.1).

While the gate is on, the rewrites of the plan (fastpath/rewrites.py) run: channels-last
activations, GroupNorm+SiLU fused, resnet 3x3 convs by Winograd F(4x4, 3x3) on CPU, nearest-2x
upsample + 3x3 conv folded into a stride-2 4x4 transposed conv, single-head attention with its
value and output projections folded into one matrix and its group norm taken on the 4-D tensor
(no transpose round trip), and on CUDA channels-last weights and conv1's bias inside norm2's
kernel. Resnets and the decoder are recomposed from the same operators whichever rewrites are
on. While the gate is off, the original bound forwards run untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.autoencoders.vae import Decoder
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D, UpDecoderBlock2D
from diffusers.models.upsampling import Upsample2D
from torch import nn

from vae_service.fastpath.folded import FoldedBuffers
from vae_service.fastpath.fused_norms import GroupNormSiLU
from vae_service.fastpath.patching import Patch
from vae_service.fastpath.rewrites import RewritePlan
from vae_service.fastpath.upsample_fold import fold_upsample_conv
from vae_service.fastpath.winograd import conv3x3_winograd, transform_filter, winograd_applies
from vae_service.models.structure import affine_group_norm, exact_type, plain_silu, unknown_modules

_ALLOWED = {
    Decoder,
    UNetMidBlock2D,
    UpDecoderBlock2D,
    ResnetBlock2D,
    Upsample2D,
    Attention,
    nn.ModuleList,
    nn.Conv2d,
    nn.GroupNorm,
    nn.SiLU,
    nn.Dropout,
    nn.Linear,
}


def check_image_decoder(decoder: nn.Module) -> list[str]:
    """Why the fast path cannot take this decoder (empty when it can)."""
    if not exact_type(decoder, Decoder):
        return [f"decoder is {type(decoder).__name__}, not diffusers' Decoder"]
    reasons = [f"unknown module {u}" for u in unknown_modules(decoder, _ALLOWED)]
    reasons += [
        f"conv {name} pads with '{m.padding_mode}'"
        for name, m in decoder.named_modules()
        if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros"
    ]
    if not (affine_group_norm(decoder.conv_norm_out) and plain_silu(decoder.conv_act)):
        reasons.append("output head is not GroupNorm + SiLU")
    for name, m in decoder.named_modules():
        if exact_type(m, ResnetBlock2D):
            ok = (
                affine_group_norm(m.norm1)
                and affine_group_norm(m.norm2)
                and plain_silu(m.nonlinearity)
                and m.upsample is None
                and m.downsample is None
                and m.time_emb_proj is None
                and m.time_embedding_norm in ("default", "group")
            )
            if not ok:
                reasons.append(f"resnet {name} is not GroupNorm+SiLU -> conv, twice, without time embedding")
        elif exact_type(m, Upsample2D):
            conv = m.conv
            ok = (
                m.use_conv
                and not m.use_conv_transpose
                and m.interpolate
                and m.norm is None
                and m.name == "conv"
                and exact_type(conv, nn.Conv2d)
                and conv.kernel_size == (3, 3)
                and conv.stride == (1, 1)
                and conv.padding == (1, 1)
                and conv.dilation == (1, 1)
                and conv.groups == 1
            )
            if not ok:
                reasons.append(f"upsampler {name} is not nearest-2x + 3x3 conv")
        elif exact_type(m, Attention):
            ok = (
                m.heads == 1
                and type(m.processor) in (AttnProcessor2_0, AttnProcessor)
                and m.group_norm is not None
                and affine_group_norm(m.group_norm)
                and m.spatial_norm is None
                and m.residual_connection
                and m.norm_q is None
                and m.norm_k is None
                and not m.is_cross_attention
                and exact_type(m.to_out[0], nn.Linear)
                and m.scale == m.inner_dim**-0.5
            )
            if not ok:
                reasons.append(
                    f"attention {name} is not single-head self-attention with group norm "
                    f"(processor {type(m.processor).__name__}, heads {m.heads})"
                )
    return reasons


class _Ops:
    """What the patched forwards call, bound once from the plan."""

    def __init__(self, plan: RewritePlan, folded: FoldedBuffers):
        self.plan, self.folded = plan, folded
        self.norm = GroupNormSiLU.bind(plan.active.get("group_norm_silu", "torch"))


class _FastConv:
    """One conv of the fast path. CPU fp32: Winograd F(4x4, 3x3) where it applies. CUDA: the
    weight as a channels-last folded copy, since cuDNN would otherwise re-layout it on every call
    for channels-last activations. `with_bias=False` leaves the bias to the caller to fuse."""

    def __init__(self, conv: nn.Conv2d, name: str, ops: _Ops):
        self.conv, self.name, self.ops = conv, name, ops
        self.winograd = "winograd" in ops.plan
        self.channels_last_weights = "channels_last_weights" in ops.plan

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        conv, folded = self.conv, self.ops.folded
        bias = conv.bias if with_bias else None
        if self.winograd and winograd_applies(conv, x):
            u = folded.get("winograd", self.name, conv.weight, lambda: transform_filter(conv.weight))
            return conv3x3_winograd(x, u, bias)
        weight = conv.weight
        if self.channels_last_weights and not weight.is_contiguous(memory_format=torch.channels_last):
            weight = folded.get(
                "channels_last_weights",
                self.name,
                conv.weight,
                lambda: conv.weight.contiguous(memory_format=torch.channels_last),
            )
        return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _fast_resnet(m: ResnetBlock2D, name: str, ops: _Ops):
    reference = m.forward
    conv1, conv2 = _FastConv(m.conv1, f"{name}.conv1", ops), _FastConv(m.conv2, f"{name}.conv2", ops)
    shortcut = _FastConv(m.conv_shortcut, f"{name}.conv_shortcut", ops) if m.conv_shortcut is not None else None
    # with the Triton norm, conv1's bias rides into norm2's kernel instead of a pass of its own
    # (on CPU oneDNN adds the bias inside the convolution already)
    fold_bias = "conv_bias_fold" in ops.plan and m.conv1.bias is not None
    norm = ops.norm

    def forward(x: torch.Tensor, temb=None, *args, **kwargs) -> torch.Tensor:
        if temb is not None:
            return reference(x, temb, *args, **kwargs)
        h = norm(x, m.norm1)
        h = norm(conv1(h, with_bias=not fold_bias), m.norm2, in_bias=m.conv1.bias if fold_bias else None)
        h = conv2(h)  # dropout is the identity in eval
        h = h.add_(shortcut(x) if shortcut is not None else x)
        return h if m.output_scale_factor == 1.0 else h.div_(m.output_scale_factor)

    return forward


def _exact_resnet(m: ResnetBlock2D):
    """ResnetBlock2D.forward's ops in its order, with SiLU in place on the norms' fresh outputs,
    the residual added in place (IEEE addition commutes) and no division by an output scale of 1
    (exact): the same bits with three fewer full-size temporaries and one pass fewer."""
    reference = m.forward

    def forward(x: torch.Tensor, temb=None, *args, **kwargs) -> torch.Tensor:
        if temb is not None or args or kwargs:
            return reference(x, temb, *args, **kwargs)
        h = m.conv1(F.silu(m.norm1(x), inplace=True))
        h = m.conv2(F.silu(m.norm2(h), inplace=True))  # dropout is the identity in eval
        h = h.add_(m.conv_shortcut(x) if m.conv_shortcut is not None else x)
        return h if m.output_scale_factor == 1.0 else h.div_(m.output_scale_factor)

    return forward


def _fast_upsample(m: Upsample2D, name: str, ops: _Ops):
    reference = m.forward

    def forward(x: torch.Tensor, output_size=None, *args, **kwargs) -> torch.Tensor:
        if output_size is not None:
            return reference(x, output_size)
        weight = ops.folded.get("upsample_fold", name, m.conv.weight, lambda: fold_upsample_conv(m.conv.weight))
        return F.conv_transpose2d(x, weight, m.conv.bias, stride=2, padding=1)

    return forward


def _fold_value_output(attn: Attention) -> torch.Tensor:
    """[W_o W_v | W_o b_v + b_o] as one (C, C + 1) matrix: softmax rows sum to one, so
    softmax(QK^T)(X W_v^T + b_v) W_o^T + b_o = softmax(QK^T) X (W_o W_v)^T + (W_o b_v + b_o)."""
    wv, wo = attn.to_v.weight.float(), attn.to_out[0].weight.float()
    bv = attn.to_v.bias.float() if attn.to_v.bias is not None else torch.zeros(wv.shape[0], device=wv.device)
    bo = attn.to_out[0].bias.float() if attn.to_out[0].bias is not None else torch.zeros(wo.shape[0], device=wo.device)
    return torch.cat([wo @ wv, (wo @ bv + bo)[:, None]], dim=1).to(attn.to_v.weight.dtype)


def _fast_attention(attn: Attention, name: str, ops: _Ops):
    reference = attn.forward
    norm = ops.norm

    def forward(x: torch.Tensor, encoder_hidden_states=None, attention_mask=None, **kwargs) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or x.dim() != 4:
            return reference(x, encoder_hidden_states, attention_mask, **kwargs)
        b, c, h, w = x.shape
        normed = norm(x, attn.group_norm, silu=False)
        rows = normed.permute(0, 2, 3, 1).reshape(b, h * w, c)  # a view when channels-last
        vo = ops.folded.get("attention_fold", name, attn.to_v.weight, lambda: _fold_value_output(attn))
        q, k = attn.to_q(rows), attn.to_k(rows)
        v = F.linear(rows, vo[:, :c], vo[:, c])
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        out = out.reshape(b, h, w, c).permute(0, 3, 1, 2).add_(x)
        return out if attn.rescale_output_factor == 1.0 else out.div_(attn.rescale_output_factor)

    return forward


def _fast_decoder(d: Decoder, ops: _Ops):
    reference = d.forward
    conv_in, conv_out = _FastConv(d.conv_in, "conv_in", ops), _FastConv(d.conv_out, "conv_out", ops)
    channels_last = "channels_last" in ops.plan
    norm = ops.norm

    def forward(sample: torch.Tensor, latent_embeds=None) -> torch.Tensor:
        if latent_embeds is not None:
            return reference(sample, latent_embeds)
        x = conv_in(sample.contiguous(memory_format=torch.channels_last) if channels_last else sample)
        x = d.mid_block(x, None)
        for up_block in d.up_blocks:
            x = up_block(x, None)
        x = conv_out(norm(x, d.conv_norm_out))
        return x.contiguous()

    return forward


def image_patches(vae: nn.Module, folded: FoldedBuffers, plan: RewritePlan) -> list[Patch]:
    decoder, ops = vae.decoder, _Ops(plan, folded)
    patches = []
    for name, m in decoder.named_modules():
        if exact_type(m, ResnetBlock2D):
            if "inplace_resnet" in plan:
                patches.append(Patch(m, "forward", _exact_resnet(m), exact=True))
            patches.append(Patch(m, "forward", _fast_resnet(m, name, ops)))
        elif exact_type(m, Upsample2D) and "upsample_fold" in plan:
            patches.append(Patch(m, "forward", _fast_upsample(m, name, ops)))
        elif exact_type(m, Attention) and "attention_fold" in plan:
            patches.append(Patch(m, "forward", _fast_attention(m, name, ops)))
    patches.append(Patch(decoder, "forward", _fast_decoder(decoder, ops)))
    return patches
