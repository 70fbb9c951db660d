"""The engine's decode of Wan-style causal decoders (models/wan_internals.py), both tiers: one
latent frame at a time, as diffusers' `AutoencoderKLWan._decode` does, yielding each chunk's
frames as soon as they exist (streaming, stopping between chunks).

The walk calls diffusers' modules in diffusers' order with the same arithmetic; only the causal
convs' history is kept differently, bit-identically (so `lossless` runs it): a causal conv's input
is built once in a buffer of [last two input frames | this chunk's frames], the norm + SiLU before
it writes into that buffer in place, and the conv pads only spatially (oneDNN and cuDNN give the
same bits as on a pre-padded input). Diffusers builds the same input with a clone, a `torch.cat`
and an `F.pad` (a zero fill and a copy) per conv per chunk.

`high` adds the fast path's video rewrites as walk options (`walk_options`): `first_frame_2d` runs
the first chunk's 3x3x3 causal convs as 2-D convs on the one tap that sees data (the other two see
the zero history), `channels_last_3d` lays the buffers out channels-last, `rms_norm_silu` fuses
each norm with its SiLU, `wan_conv_bias_fold` adds conv1's bias inside norm2's kernel.

The two-frame history matches diffusers' cache exactly: it holds the last one or two frames seen,
and the conv pads the missing ones with zeros; the temporal upsampler skips its conv on the first
chunk ("Rep") and pads with zeros on the second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vae_service.fastpath.folded import FoldedBuffers
from vae_service.fastpath.fused_norms import WanRMSNormSiLU
from vae_service.fastpath.rewrites import RewritePlan
from vae_service.models.wan_internals import HISTORY, finished_chunk, spatial_padding, upsampler_of

RMS_EPS = 1e-12  # F.normalize's default, which WanRMS_norm uses

NormSiLU = Callable[..., torch.Tensor]  # (x, norm, in_bias=None, out=None): fused_norms.WanRMSNormSiLU


def exact_rms_norm_silu_into(x: torch.Tensor, norm: nn.Module, out: torch.Tensor, x_is_spare: bool = False) -> None:
    """SiLU(WanRMS_norm(x)) copied into `out`: diffusers' ops in diffusers' order (the norm is
    F.normalize's: x / max(||x||_2 over channels, eps)), in place on one temporary instead of five.
    The temporary is laid out like diffusers' (SiLU's vectorised and scalar loops round `exp`
    differently, so it must see the same element order); `out` gets a plain copy. `x_is_spare`:
    nothing reads x afterwards, so it is the temporary (fp32, contiguous: the layout diffusers'
    result would have)."""
    low_precision = x.dtype in (torch.float16, torch.bfloat16)
    xf = x.float() if low_precision else x
    denom = xf.norm(2, 1, keepdim=True).clamp_min_(RMS_EPS)
    spare = x_is_spare and not low_precision and x.is_contiguous()
    y = x.div_(denom) if spare else xf / denom
    if low_precision:
        y = y.to(x.dtype)
    y.mul_(norm.scale).mul_(norm.gamma).add_(norm.bias)
    out.copy_(F.silu(y, inplace=True))


@dataclass(frozen=True)
class WalkOptions:
    norm_silu: NormSiLU | None = None  # None: the exact in-place composition
    first_frame_2d: bool = False
    channels_last: bool = False
    conv_bias_fold: bool = False  # conv1's bias added inside norm2's op (needs `norm_silu`)


class Walk:
    """One decode's pass over the chunks: holds each causal conv's history between chunks (a decode
    session keeps one between requests: engine/execution/session.py).

    A history tensor is never written after it is made (each step replaces it with a new one), so a
    `fork` (a shallow copy) is a snapshot: a session runs a chunk on a fork and keeps it only when
    the whole chunk decoded."""

    def __init__(self, decoder: nn.Module, options: WalkOptions, folded: FoldedBuffers):
        self.d, self.options, self.folded = decoder, options, folded
        self.history: dict[nn.Module, torch.Tensor] = {}
        self.started_upsamplers: set[nn.Module] = set()
        self.first_chunk = True
        self.steps = 0  # latent frames walked
        self.format = torch.channels_last_3d if options.channels_last else torch.contiguous_format

    @property
    def phase(self) -> int:
        """Which convs hold a history: none (0), all but the temporal upsamplers' (1), all (2).
        Walks of one phase (and options) have histories of one layout: they can be stacked."""
        return min(self.steps, 2)

    @property
    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.history.values())

    def fork(self) -> Walk:
        other = object.__new__(Walk)
        other.__dict__.update(self.__dict__)
        other.history, other.started_upsamplers = dict(self.history), set(self.started_upsamplers)
        return other

    @staticmethod
    def stacked(walks: list[Walk]) -> Walk:
        """One walk over the batch of `walks` (one phase, one item each): their histories joined on
        the batch dimension, in order."""
        first = walks[0]
        if len(walks) == 1:
            return first.fork()
        if any(w.phase != first.phase or w.options != first.options for w in walks):
            raise ValueError("walks of different phases or options cannot be stacked")
        joined = first.fork()
        joined.history = {conv: torch.cat([w.history[conv] for w in walks]) for conv in first.history}
        return joined

    def split(self, count: int) -> list[Walk]:
        """The stacked walk's items as walks of their own; each history copied out, so that a session
        that stops holds its own history, never its batch's."""
        if count == 1:
            return [self]
        parts = []
        for i in range(count):
            part = self.fork()
            part.history = {conv: t[i : i + 1].clone() for conv, t in self.history.items()}
            parts.append(part)
        return parts

    # ---- causal convs ------------------------------------------------------------------------
    def _input_of(self, conv: nn.Module, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(buffer, where this chunk's frames go): the buffer starts with the conv's history. In the
        first chunk under `first_frame_2d` there is no buffer: the frames alone feed a 2-D conv."""
        b, c, t, h, w = like.shape
        if self._as_2d(conv):
            return None, torch.empty((b, c, t, h, w), dtype=like.dtype, device=like.device, memory_format=self.format)
        buf = torch.empty((b, c, HISTORY + t, h, w), dtype=like.dtype, device=like.device, memory_format=self.format)
        history = self.history.get(conv)
        if history is None:
            buf[:, :, :HISTORY].zero_()
        else:
            buf[:, :, :HISTORY].copy_(history)
        return buf, buf[:, :, HISTORY:]

    def _as_2d(self, conv: nn.Module) -> bool:
        return self.options.first_frame_2d and self.first_chunk and conv not in self.history

    def _conv(self, conv: nn.Module, buf: torch.Tensor | None, frames: torch.Tensor, bias: bool = True) -> torch.Tensor:
        padding = (0, *spatial_padding(conv))
        bias = conv.bias if bias else None
        if buf is None:  # first chunk, 2-D: the zero history contributes nothing but rounding
            self.history[conv] = torch.cat([torch.zeros_like(frames), frames], 2)[:, :, -HISTORY:]
            weight = self.folded.get(
                "first_frame_2d", f"{id(conv)}", conv.weight, lambda: conv.weight[:, :, -1].contiguous()
            )
            out = F.conv2d(frames[:, :, 0], weight, bias, conv.stride[1:], padding[1:])
            return out.unsqueeze(2)
        self.history[conv] = buf[:, :, -HISTORY:].clone()
        return F.conv3d(buf, conv.weight, bias, conv.stride, padding)

    def _norm_conv(
        self,
        norm: nn.Module,
        x: torch.Tensor,
        conv: nn.Module,
        in_bias: torch.Tensor | None = None,
        conv_bias: bool = True,
        x_is_spare: bool = False,
    ) -> torch.Tensor:
        """conv(SiLU(norm(x + in_bias))), the norm's output written straight into the conv's input
        buffer; `conv_bias` False leaves the conv's bias to the next norm (conv_bias_fold);
        `x_is_spare`: x is not read afterwards."""
        buf, frames = self._input_of(conv, x)
        if self.options.norm_silu is None:
            exact_rms_norm_silu_into(x, norm, frames, x_is_spare)
        else:
            self.options.norm_silu(x, norm, in_bias=in_bias, out=frames)
        return self._conv(conv, buf, frames, conv_bias)

    def _plain_conv(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        buf, frames = self._input_of(conv, x)
        frames.copy_(x)
        return self._conv(conv, buf, frames)

    # ---- blocks ------------------------------------------------------------------------------
    def _residual(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shortcut = block.conv_shortcut(x)  # identity or a 1x1x1 conv: diffusers' module as is
        fold = self.options.conv_bias_fold
        h = self._norm_conv(block.norm1, x, block.conv1, conv_bias=not fold)
        in_bias = block.conv1.bias if fold else None
        h = self._norm_conv(block.norm2, h, block.conv2, in_bias, x_is_spare=True)  # dropout: identity
        return h.add_(shortcut)

    def _resample(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if m.mode == "upsample3d":
            if m not in self.started_upsamplers:  # diffusers' "Rep": no temporal conv on the first chunk
                self.started_upsamplers.add(m)
            else:
                x = self._plain_conv(m.time_conv, x)
                x = x.reshape(b, 2, c, t, h, w)
                x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
                x = x.reshape(b, c, t * 2, h, w)
        t = x.shape[2]
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        x = m.resample(x)
        return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)

    def _up_block(self, up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Wan2.1/Qwen-Image up blocks (resnets, then `upsamplers[0]`) and Wan2.2's residual ones
        (resnets, `upsampler`, plus a channel-duplicating shortcut of the block's input that drops
        its leading frames on the first chunk). No step writes into the block's input in place."""
        block_input = x
        for resnet in up.resnets:
            x = self._residual(resnet, x)
        upsampler = upsampler_of(up)
        if upsampler is not None:
            x = self._resample(upsampler, x)
        shortcut = getattr(up, "avg_shortcut", None)
        if shortcut is not None:
            x = x + shortcut(block_input, first_chunk=self.first_chunk)
        return x

    def chunk(self, x: torch.Tensor) -> torch.Tensor:
        d = self.d
        x = self._plain_conv(d.conv_in, x)
        mid = d.mid_block
        x = self._residual(mid.resnets[0], x)
        for attention, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            x = self._residual(resnet, attention(x))
        for up in d.up_blocks:
            x = self._up_block(up, x)
        x = self._norm_conv(d.norm_out, x, d.conv_out, x_is_spare=True)
        self.first_chunk = False
        self.steps += 1
        return x


def walk_options(plan: RewritePlan) -> dict[str, WalkOptions]:
    """How each tier walks: `lossless` with diffusers' arithmetic, `high` with the plan's video
    rewrites (an empty plan: the same as lossless)."""
    fused = "rms_norm_silu" in plan  # Triton only: elsewhere the exact composition is the fastest
    high = WalkOptions(
        norm_silu=WanRMSNormSiLU.bind(plan.active["rms_norm_silu"]) if fused else None,
        first_frame_2d="first_frame_2d" in plan,
        channels_last="channels_last_3d" in plan,
        conv_bias_fold="wan_conv_bias_fold" in plan,
    )
    return {"lossless": WalkOptions(), "high": high}


def walk_chunks(
    vae: nn.Module, z: torch.Tensor, options: WalkOptions, folded: FoldedBuffers | None = None
) -> Iterator[torch.Tensor]:
    """`vae.decode(z).sample` split along time: one tensor per latent frame ([B, 3, t, H, W],
    clamped like diffusers), whose concatenation is that decode (bit-identical with the default
    options). The whole clip is at hand: its post-quant conv runs on it as diffusers' does."""
    walk = Walk(vae.decoder, options, FoldedBuffers() if folded is None else folded)
    yield from _frames(vae, walk, vae.post_quant_conv(z))


def walk_on(
    vae: nn.Module, walk: Walk, z: torch.Tensor, clip_latent_frames: int | None = None
) -> Iterator[torch.Tensor]:
    """`walk_chunks` continuing `walk` (a session's, carried from its earlier chunks) over the chunk
    `z` of a clip of `clip_latent_frames` latent frames (None: unknown), its post-quant conv given
    the bits the whole clip's would have (chunk_post_quant)."""
    yield from _frames(vae, walk, chunk_post_quant(vae.post_quant_conv, z, clip_latent_frames, walk.steps))


def _frames(vae: nn.Module, walk: Walk, x: torch.Tensor) -> Iterator[torch.Tensor]:
    for i in range(x.shape[2]):
        yield finished_chunk(vae, walk.chunk(x[:, :, i : i + 1]))


# Below this many positions (t * H * W) the CPU GEMM under a 1x1x1 conv takes small-matrix paths
# whose bits differ from a larger call's; from it on, a position's bits do not depend on how many
# are computed with it (measured on AMD EPYC, torch 2.13: padded to 12..128 positions, a chunk
# mismatched only whole clips of at most 10 positions; unpadded, clips of up to 84).
MIN_GEMM_POSITIONS = 32


def chunk_post_quant(
    conv: nn.Module, z: torch.Tensor, clip_latent_frames: int | None = None, start: int = 0
) -> torch.Tensor:
    """The 1x1x1 post-quant conv of a chunk `z` [B, C, t, H, W] with the bits diffusers' conv of the
    whole clip gives those frames. A 1x1x1 conv computes each position alone, but on CPU torch picks
    its kernel by the input's size (native GEMM for small inputs, oneDNN past C * T * H = 20480) and
    the GEMM's path by the positions' count: so the chunk runs on the kernel torch would pick for
    the whole clip where its length is known (else on the chunk's own), padded with zero frames to
    MIN_GEMM_POSITIONS where the native GEMM would otherwise take its small-matrix path. A clip,
    known, that small itself takes a small path whose bits depend on a position's place: the chunk
    then runs at its own place (`start`, its first latent frame) in a zero clip of the clip's size."""
    if z.device.type != "cpu":
        return conv(z)  # cuDNN's algorithm is its own choice; exact on GPU is not claimed (docs/fast-path.md)
    if clip_latent_frames and clip_latent_frames > z.shape[2] and _whole_runs_on_onednn(conv, z, clip_latent_frames):
        return torch.ops.aten.mkldnn_convolution(
            z.contiguous(), conv.weight, conv.bias, conv.padding, conv.stride, conv.dilation, conv.groups
        )
    t, plane = z.shape[2], z.shape[3] * z.shape[4]
    if t * plane >= MIN_GEMM_POSITIONS or _on_onednn(conv, z):
        return conv(z)
    if clip_latent_frames and clip_latent_frames * plane < MIN_GEMM_POSITIONS and start + t <= clip_latent_frames:
        whole = z.new_zeros(*z.shape[:2], clip_latent_frames, *z.shape[3:])
        whole[:, :, start : start + t] = z
        return conv(whole)[:, :, start : start + t]
    frames = -(-MIN_GEMM_POSITIONS // plane)
    padded = torch.cat([z, z.new_zeros(*z.shape[:2], frames - t, *z.shape[3:])], dim=2)
    return conv(padded)[:, :, :t]


def post_quant_key(
    clip_latent_frames: int | None, start: int, t: int, plane: int, device: torch.device
) -> tuple[int | None, int | None]:
    """What of a chunk's place in its clip chunk_post_quant's bits depend on, beyond the chunk's own
    shape: on CPU, the clip's length where it is known, and the chunk's first latent frame where the
    clip is so small that it runs at its place in a zero clip (elsewhere nothing: the conv runs on
    the chunk as it is). Chunks stacked in one call share it."""
    if clip_latent_frames is None or device.type != "cpu":
        return None, None
    in_place = t * plane < MIN_GEMM_POSITIONS and clip_latent_frames * plane < MIN_GEMM_POSITIONS
    return clip_latent_frames, start if in_place else None


def _on_onednn(conv: nn.Module, x: torch.Tensor) -> bool:
    backend = torch._C._select_conv_backend(
        x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, False, (0, 0, 0), conv.groups, None
    )
    return backend == torch._C._ConvBackend.Mkldnn


def _whole_runs_on_onednn(conv: nn.Module, z: torch.Tensor, clip_latent_frames: int) -> bool:
    """Whether torch would run the whole clip's conv on oneDNN (asked of a zero-strided stand-in: no
    clip-sized tensor is made)."""
    shape = (*z.shape[:2], clip_latent_frames, *z.shape[3:])
    return _on_onednn(conv, z.new_zeros(()).expand(shape))
