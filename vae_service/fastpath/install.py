"""Installing the fast path on a loaded VAE: once, idempotently, only on fully supported
structures, all or nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from vae_service.fastpath.folded import FoldedBuffers
from vae_service.fastpath.gate import FastPathGate
from vae_service.fastpath.patching import apply_all

log = logging.getLogger(__name__)
_ATTR = "_vae_service_fast_path"  # a plain attribute: not a module, parameter or buffer


@dataclass
class FastPath:
    gate: FastPathGate = field(default_factory=FastPathGate)
    folded: FoldedBuffers = field(default_factory=FoldedBuffers)
    installed: bool = False
    skipped_because: list[str] = field(default_factory=list)

    def release(self) -> int:
        return self.folded.release()

    def describe(self) -> dict:
        return {"installed": self.installed, "skipped_because": self.skipped_because[:5],
                "folded_bytes": self.folded.nbytes}


def _plan(vae: nn.Module, folded: FoldedBuffers):
    from diffusers import AutoencoderKL, AutoencoderKLWan

    if type(vae) is AutoencoderKL:
        from vae_service.fastpath.image_vae import check_image_decoder, image_patches

        return check_image_decoder(vae.decoder), lambda: image_patches(vae, folded)
    if type(vae) is AutoencoderKLWan:
        from vae_service.fastpath.wan_vae import check_wan_decoder, wan_patches

        return check_wan_decoder(vae.decoder), lambda: wan_patches(vae)
    return [f"no fast path for {type(vae).__name__}"], None


def install_fast_path(vae: nn.Module) -> FastPath:
    existing = vae.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    fast_path = FastPath()
    reasons, make_patches = _plan(vae, fast_path.folded)
    if reasons:
        fast_path.skipped_because = reasons
        log.warning("fast path not installed on %s (high runs reference operators): %s",
                    type(vae).__name__, "; ".join(reasons[:5]))
    else:
        try:
            apply_all(make_patches(), fast_path.gate)
            fast_path.installed = True
        except Exception as exc:  # the reference path is intact (apply_all reverted)
            fast_path.skipped_because = [f"install failed: {type(exc).__name__}: {exc}"]
            log.exception("fast path install failed on %s; serving reference operators", type(vae).__name__)
    vae.__dict__[_ATTR] = fast_path
    return fast_path
