"""The fast path's rewrites by name. Each one can be disabled by config (`fast_path.disable`),
applies only where it pays (device, precision) and binds its backend once, at install. `exact`
rewrites change no arithmetic (tests prove bit-identity with diffusers), so both tiers use them;
the others are `high` only.

No diffusers import here: the config validates names against this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def _anywhere(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def _cpu_fp32(device: torch.device, dtype: torch.dtype) -> str | None:
    # oneDNN's direct fp32 convolution is what it beats; CUDA's cuDNN picks Winograd itself
    return None if device.type == "cpu" and dtype == torch.float32 else "CPU fp32 only"


def _cuda(device: torch.device, dtype: torch.dtype) -> str | None:
    return None if device.type == "cuda" else "CUDA only"


@dataclass(frozen=True)
class Rewrite:
    name: str
    family: str  # image | video
    summary: str
    applies: Callable[[torch.device, torch.dtype], str | None] = _anywhere  # None, or why not here
    exact: bool = False


REWRITES: dict[str, Rewrite] = {
    r.name: r
    for r in [
        Rewrite("channels_last", "image", "activations channels-last"),
        Rewrite(
            "group_norm_silu",
            "image",
            "GroupNorm + SiLU as one op: a Triton kernel on CUDA, the exact torch composition elsewhere",
        ),
        Rewrite("upsample_fold", "image", "nearest-2x upsample + 3x3 conv as one stride-2 4x4 transposed conv"),
        Rewrite(
            "attention_fold",
            "image",
            "single-head attention with value and output projections folded into "
            "one matrix, its group norm taken without a layout round trip",
        ),
        Rewrite("winograd", "image", "3x3 convs of 64+ channels by Winograd F(4x4, 3x3)", _cpu_fp32),
        Rewrite(
            "channels_last_weights",
            "image",
            "conv weights kept channels-last (cuDNN would re-layout them per call)",
            _cuda,
        ),
        Rewrite(
            "conv_bias_fold",
            "image",
            "resnet conv1 bias added inside norm2's kernel instead of a pass of its own (with the Triton GroupNorm)",
        ),
        Rewrite(
            "inplace_resnet",
            "image",
            "resnet blocks with SiLU and the residual add in place and no division by an output scale of 1",
            exact=True,
        ),
        Rewrite(
            "causal_cache",
            "video",
            "Wan causal convs fed from one buffer of [two history frames | chunk] and spatial conv padding "
            "instead of clone + cat + pad per conv per chunk; norm + SiLU on one temporary",
            exact=True,
        ),
        Rewrite(
            "first_frame_2d",
            "video",
            "the first latent frame's 3x3x3 causal convs as 2-D convs on the one tap that sees data",
        ),
        Rewrite("channels_last_3d", "video", "activations channels-last-3d"),
        Rewrite(
            "wan_conv_bias_fold",
            "video",
            "resnet conv1 bias added inside norm2's Triton kernel, each norm writing straight into the next "
            "conv's input buffer",
        ),
        Rewrite(
            "rms_norm_silu",
            "video",
            "Wan RMSNorm + SiLU as one op: a Triton kernel on CUDA, the exact torch composition elsewhere",
        ),
    ]
}
REWRITE_NAMES = tuple(REWRITES)
NORM_REWRITES = ("group_norm_silu", "rms_norm_silu")


@dataclass
class RewritePlan:
    """Which rewrites run on this VAE and with which backend, and why the others do not."""

    active: dict[str, str] = field(default_factory=dict)  # name -> backend
    inactive: dict[str, str] = field(default_factory=dict)  # name -> reason

    def __contains__(self, name: str) -> bool:
        return name in self.active


def triton_backend_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def plan_rewrites(
    family: str,
    device: torch.device,
    dtype: torch.dtype,
    disabled: tuple[str, ...] = (),
    norm_backend: str | None = None,
) -> RewritePlan:
    """`norm_backend` forces the fused norms' backend ('triton' or 'torch'); by default Triton on
    CUDA when it imports, the exact torch composition elsewhere."""
    norm_backend = norm_backend or ("triton" if triton_backend_available(device) else "torch")
    plan = RewritePlan()
    for name, rewrite in REWRITES.items():
        if rewrite.family != family:
            continue
        why_not = "disabled by config (fast_path.disable)" if name in disabled else rewrite.applies(device, dtype)
        if why_not is None and name == "conv_bias_fold" and (norm_backend != "triton" or "group_norm_silu" in disabled):
            why_not = "needs group_norm_silu on its Triton backend"
        if why_not is None and name == "first_frame_2d" and "causal_cache" in disabled:
            why_not = "needs causal_cache"
        if (
            why_not is None
            and name == "wan_conv_bias_fold"
            and (norm_backend != "triton" or {"rms_norm_silu", "causal_cache"} & set(disabled))
        ):
            why_not = "needs causal_cache and rms_norm_silu on its Triton backend"
        if why_not is None:
            fused = name in NORM_REWRITES or name in ("conv_bias_fold", "wan_conv_bias_fold")
            plan.active[name] = norm_backend if fused else "torch"
        else:
            plan.inactive[name] = why_not
    return plan
