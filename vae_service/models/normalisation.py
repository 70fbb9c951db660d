"""The latent normalisation each diffusers pipeline undoes before `vae.decode`, as data, and its
arithmetic, op for op in the pipeline's order and dtype: a lossless decode is bit-identical to
the pipeline's only if these are (in bf16, `x / (1 / std)` and `x * std` already differ in one
element of six).

Kinds (`z` the latents, `dt` the decode dtype):
- `none`: z as sent (what `vae.decode` takes).
- `factors`: `z / scaling + shift` (either optional): SD, SDXL, FLUX.1, HunyuanVideo, SANA.
- `reciprocal_scaling`: `(1 / scaling) * z`: CogVideoX, Allegro, EasyAnimate.
- `mean_inv_std`: `z / (1 / std.to(dt)) + mean.to(dt)`: Wan, Qwen-Image.
- `mean_std`: `z * std + mean`: Qwen-Image 2.1, MiniMax-H3.
- `mean_std_scaled`: `z * std / scaling + mean`: LTX-Video, LTX-2 (statistics in module
  buffers), Mochi, Cosmos (per channel and latent frame, `scaling` = the scheduler's sigma_data),
  SDXL-style AutoencoderKL configs that carry `latents_mean`.
- `batch_norm`: `z * sqrt(running_var + eps).to(dt) + running_mean.to(dt)` on 2x2-patchified
  latents: FLUX.2 (the statistics are its `bn` module's buffers).
`in_fp32`: the pipeline normalises fp32 latents and casts to the decode dtype afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Kind = Literal["none", "factors", "reciprocal_scaling", "mean_inv_std", "mean_std", "mean_std_scaled", "batch_norm"]


@dataclass(frozen=True)
class Normalisation:
    kind: Kind = "none"
    scaling: float | None = None
    shift: float | None = None
    mean: tuple[float, ...] | None = None  # per channel (or per channel and latent frame); None: buffers
    std: tuple[float, ...] | None = None
    in_fp32: bool = False
    per_frame: bool = False  # statistics per channel and latent frame (Cosmos), else per channel

    def describe(self) -> str:
        z = "z"
        formula = {
            "none": z,
            "factors": " + ".join(
                filter(None, [f"z / {self.scaling}" if self.scaling is not None else z, _opt(self.shift)])
            ),
            "reciprocal_scaling": f"(1 / {self.scaling}) * z",
            "mean_inv_std": "z / (1 / latents_std) + latents_mean",
            "mean_std": "z * latents_std + latents_mean",
            "mean_std_scaled": f"z * latents_std / {self.scaling} + latents_mean",
            "batch_norm": "z * sqrt(bn.running_var + eps) + bn.running_mean (2x2-patchified channels)",
        }[self.kind]
        return formula + (" (in fp32)" if self.in_fp32 else "")

    def stats_frames(self, channels: int) -> int | None:
        """Latent frames the statistics cover (None: per channel, any number of frames)."""
        return len(self.mean) // channels if self.per_frame and self.mean is not None else None


def _opt(shift: float | None) -> str | None:
    return None if shift is None else str(shift)


def divide_and_shift(z: torch.Tensor, scaling: float | None, shift: float | None) -> torch.Tensor:
    """`z / scaling + shift`, each step skipped where its factor is None."""
    if scaling is not None:
        z = z / scaling
    return z if shift is None else z + shift


def factors(scaling: float | None, shift: float | None = None) -> Normalisation:
    return Normalisation("factors" if scaling is not None or shift is not None else "none", scaling, shift)


class Denormaliser:
    """A model's normalisation bound to its statistics on the decode device, in the decode dtype
    (built once per engine). `apply(z)` takes latents in the decoder's layout."""

    def __init__(self, norm: Normalisation, vae: nn.Module, channels: int, dtype: torch.dtype):
        # FLUX.2's statistics are per 2x2-patchified channel
        self.norm, self.channels = norm, channels * 4 if norm.kind == "batch_norm" else channels
        self.work_dtype = torch.float32 if norm.in_fp32 else dtype
        device = next(vae.parameters()).device
        mean, std = norm.mean, norm.std
        if norm.kind == "batch_norm":  # FLUX.2: the pipeline's own expression on the `bn` buffers
            bn = vae.bn
            mean = bn.running_mean
            std = torch.sqrt(bn.running_var + bn.eps)
        elif mean is None and norm.kind not in ("none", "factors", "reciprocal_scaling"):
            mean, std = vae.latents_mean, vae.latents_std  # LTX: buffers loaded with the weights
        self.mean = self.std = None
        if mean is not None:
            self.mean = self._stat(mean, device)
            self.std = self._stat(std, device)
            if norm.kind == "mean_inv_std":
                self.std = 1.0 / self.std  # the reciprocal of the cast statistic, as the pipelines do

    def _stat(self, values, device: torch.device) -> torch.Tensor:
        """[C, F] (F = 1 unless per frame); raises ValueError when the statistics do not match the
        model's latent channels."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values)
        if t.numel() != self.channels and not (self.norm.per_frame and t.numel() % self.channels == 0):
            raise ValueError(f"{t.numel()} latent statistics for {self.channels} latent channels")
        return t.reshape(self.channels, -1).to(device, self.work_dtype)

    def _shaped(self, stat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """[C, F] statistics against [B, C, (T,) H, W] latents: per channel, and per latent frame
        when the statistics have frames (Cosmos: the first T of them)."""
        if z.dim() == 4:
            return stat[:, :1].view(1, -1, 1, 1)
        return stat[:, : z.shape[2]].view(1, self.channels, -1, 1, 1)

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        n, kind = self.norm, self.norm.kind
        if kind == "none":
            return z
        if kind == "factors":
            return divide_and_shift(z, n.scaling, n.shift)
        if kind == "reciprocal_scaling":
            return 1 / n.scaling * z
        if kind == "batch_norm":
            return _on_patches(z, lambda p, stat: p * stat(self.std) + stat(self.mean))
        mean, std = self._shaped(self.mean, z), self._shaped(self.std, z)
        if kind == "mean_inv_std":
            return z / std + mean
        if kind == "mean_std":
            return z * std + mean
        return z * std / n.scaling + mean  # mean_std_scaled


def _on_patches(z: torch.Tensor, op) -> torch.Tensor:
    """`op` on [B, 4C, 1, 1]-shaped statistics against [B, C, 2h, 2w] latents, per 2x2-patchified
    channel (channel c * 4 + dy * 2 + dx holds pixel (2y + dy, 2x + dx)): the latents are viewed as
    [B, C, h, 2, w, 2] and the statistics broadcast over it, so no patchified copy is made; each
    element meets the same operands as in the pipeline's patchified layout."""
    b, c, h2, w2 = z.shape
    patches = z.reshape(b, c, h2 // 2, 2, w2 // 2, 2)

    def per_patch_channel(stat: torch.Tensor) -> torch.Tensor:
        return stat.reshape(1, c, 2, 2)[:, :, None, :, None, :]

    return op(patches, per_patch_channel).reshape(b, c, h2, w2)
