"""Gated instance-level method patches: no module is replaced and no parameter renamed, so
state dicts load strictly before and after; with the gate off the original bound method runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from vae_service.fastpath.gate import FastPathGate


@dataclass
class Patch:
    module: nn.Module
    method: str
    fast: Callable
    exact: bool = False  # an exact rewrite (bit-identical): runs whatever the gate says

    def apply(self, gate: FastPathGate) -> None:
        if self.exact:
            setattr(self.module, self.method, self.fast)
            return
        reference = getattr(self.module, self.method)
        fast = self.fast

        def gated(*args, **kwargs):
            return fast(*args, **kwargs) if gate.enabled else reference(*args, **kwargs)

        setattr(self.module, self.method, gated)

    def revert(self) -> None:
        self.module.__dict__.pop(self.method, None)


def apply_all(patches: list[Patch], gate: FastPathGate) -> None:
    """All or nothing: a failure part-way leaves every module on its reference method. Exact
    patches go first, so a gated patch of the same method falls back to the exact one."""
    patches = sorted(patches, key=lambda p: not p.exact)
    try:
        for patch in patches:
            patch.apply(gate)
    except BaseException:
        for patch in patches:
            patch.revert()
        raise
