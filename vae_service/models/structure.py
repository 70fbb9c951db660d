"""Structure checks: the fast path's rewrites and the engine's Wan walk run only on modules whose
exact type and configuration they were written for."""

from __future__ import annotations

from torch import nn


def exact_type(module: nn.Module, cls: type | tuple[type, ...]) -> bool:
    return type(module) in (cls if isinstance(cls, tuple) else (cls,))


def plain_silu(module: nn.Module) -> bool:
    return type(module) is nn.SiLU and not module.inplace


def affine_group_norm(module: nn.Module) -> bool:
    return type(module) is nn.GroupNorm and module.affine


def unknown_modules(root: nn.Module, allowed: set[type]) -> list[str]:
    return [f"{name or '<root>'} ({type(m).__name__})" for name, m in root.named_modules() if type(m) not in allowed]
