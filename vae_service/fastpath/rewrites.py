"""The fast path's rewrites by name. Each one can be disabled by config (`fast_path.disable`),
applies only where it pays (device, precision) and binds its backend once, at install. `exact`
rewrites change no arithmetic (tests prove bit-identity with diffusers), so both tiers use them;
the others are `high` only. A rewrite declares what it builds on (`requires`: other rewrites, and
`triton`: the fused norms on their Triton backend); the plan admits it only when those are in.

No diffusers import here; the config validates names against vae_service/names.py, which a test
keeps equal to this table.
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
    requires: tuple[str, ...] = ()  # rewrites it builds on, listed before it
    triton: bool = False  # it runs inside the Triton norm kernel
    fused: bool = False  # bound to the fused norms' backend (triton | torch)

    def missing(self, plan: RewritePlan, norm_backend: str) -> str | None:
        """Why what it requires is not there, or None."""
        needs = [r for r in self.requires if r not in plan]
        if self.triton and norm_backend != "triton":
            needs.append("the Triton norm backend")
        return f"needs {' and '.join(needs)}" if needs else None


REWRITES: dict[str, Rewrite] = {
    r.name: r
    for r in [
        Rewrite("channels_last", "image", "activations channels-last"),
        Rewrite(
            "group_norm_silu",
            "image",
            "GroupNorm + SiLU as one op: a Triton kernel on CUDA, the exact torch composition elsewhere",
            fused=True,
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
            requires=("group_norm_silu",),
            triton=True,
            fused=True,
        ),
        Rewrite(
            "inplace_resnet",
            "image",
            "resnet blocks with SiLU and the residual add in place and no division by an output scale of 1",
            exact=True,
        ),
        Rewrite(
            "first_frame_2d",
            "video",
            "the first latent frame's 3x3x3 causal convs as 2-D convs on the one tap that sees data",
        ),
        Rewrite("channels_last_3d", "video", "activations channels-last-3d (the causal history buffers too)"),
        Rewrite(
            "rms_norm_silu",
            "video",
            "Wan RMSNorm + SiLU as one op, a Triton kernel (without it the walk's exact composition)",
            triton=True,
            fused=True,
        ),
        Rewrite(
            "wan_conv_bias_fold",
            "video",
            "resnet conv1 bias added inside norm2's Triton kernel, each norm writing straight into the next "
            "conv's input buffer",
            requires=("rms_norm_silu",),
            triton=True,
            fused=True,
        ),
    ]
}
REWRITE_NAMES = tuple(REWRITES)
# names that were rewrites once, and what became of them (a config naming one is told)
RETIRED_REWRITES = {
    "causal_cache": "Wan-style decoders are always decoded by the engine's walk now (bit-identical); nothing to disable"
}
NORM_REWRITES = ("group_norm_silu", "rms_norm_silu")  # the fused norms; the others build on them


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
        if name in disabled:
            why_not = "disabled by config (fast_path.disable)"
        else:
            why_not = rewrite.applies(device, dtype) or rewrite.missing(plan, norm_backend)
        if why_not is None:
            plan.active[name] = norm_backend if rewrite.fused else "torch"
        else:
            plan.inactive[name] = why_not
    return plan
