"""Installing the fast path on a loaded VAE: once, idempotently, only on fully supported
structures, all or nothing, with the rewrites the plan admits on the weights' device and dtype."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from vae_service.fastpath.folded import FoldedBuffers
from vae_service.fastpath.gate import FastPathGate
from vae_service.fastpath.patching import apply_all
from vae_service.fastpath.rewrites import REWRITES, RewritePlan, plan_rewrites

log = logging.getLogger(__name__)
_ATTR = "_vae_service_fast_path"  # a plain attribute: not a module, parameter or buffer


@dataclass
class FastPath:
    gate: FastPathGate = field(default_factory=FastPathGate)
    folded: FoldedBuffers = field(default_factory=FoldedBuffers)
    plan: RewritePlan = field(default_factory=RewritePlan)
    installed: bool = False
    skipped_because: list[str] = field(default_factory=list)

    def release(self) -> int:
        return self.folded.release()

    def describe(self) -> dict:
        folded = self.folded.nbytes_by_rewrite()
        rewrites = (
            {
                name: {
                    "backend": backend,
                    "tiers": ["lossless", "high"] if REWRITES[name].exact else ["high"],
                    "folded_bytes": folded.get(name, 0),
                    "summary": REWRITES[name].summary,
                }
                for name, backend in self.plan.active.items()
            }
            if self.installed
            else {}
        )
        return {
            "installed": self.installed,
            "rewrites": rewrites,
            "not_applied": dict(self.plan.inactive),
            "skipped_because": self.skipped_because[:5],
            "folded_bytes": self.folded.nbytes,
        }


def _structure(vae: nn.Module):
    """(family, reasons it cannot be patched, patch builder)."""
    from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage, AutoencoderKLWan

    if type(vae) in (AutoencoderKL, AutoencoderKLFlux2):  # the same Decoder behind one post-quant conv
        from vae_service.fastpath.image_vae import check_image_decoder, image_patches

        return "image", check_image_decoder(vae.decoder), image_patches
    if type(vae) in (AutoencoderKLWan, AutoencoderKLQwenImage):
        # no module patches: the engine's Wan walk runs the plan's video rewrites as its options
        from vae_service.models.wan_internals import walk_unsupported_because

        return "video", walk_unsupported_because(vae), lambda v, folded, plan: []
    return None, [f"no fast path for {type(vae).__name__}"], None


def install_fast_path(
    vae: nn.Module,
    disabled: tuple[str, ...] = (),
    norm_backend: str | None = None,
    plan_device: torch.device | None = None,
) -> FastPath:
    """`disabled`: rewrite names to leave out; `norm_backend` forces the fused norms' backend
    (tests run the Triton kernels on CPU under TRITON_INTERPRET=1 this way); `plan_device`: choose
    the rewrites as for that device (a meta twin pricing a real engine's `high` graph)."""
    existing = vae.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    fast_path = FastPath()
    family, reasons, make_patches = _structure(vae)
    if family is not None:
        weight = next(vae.parameters())
        device = plan_device or weight.device
        fast_path.plan = plan_rewrites(family, device, weight.dtype, tuple(disabled), norm_backend)
        if not reasons and not fast_path.plan.active:
            reasons = ["every rewrite is disabled or does not apply here"]
    if reasons:
        fast_path.skipped_because = reasons
        log.warning(
            "fast path not installed on %s (its high requests are answered by lossless): %s",
            type(vae).__name__,
            "; ".join(reasons[:5]),
        )
    else:
        try:
            apply_all(make_patches(vae, fast_path.folded, fast_path.plan), fast_path.gate)
            fast_path.installed = True
            log.info("fast path on %s: %s", type(vae).__name__, fast_path.plan.active)
        except Exception as exc:  # the reference path is intact (apply_all reverted)
            fast_path.skipped_because = [f"install failed: {type(exc).__name__}: {exc}"]
            log.exception("fast path install failed on %s; serving reference operators", type(vae).__name__)
    vae.__dict__[_ATTR] = fast_path
    return fast_path
