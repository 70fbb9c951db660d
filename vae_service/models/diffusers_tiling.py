"""A model as `vae.enable_tiling()` leaves it, for `lossless` decodes above the memory bound: the
class's own tiled decode with its default tile settings, so the answer is bit-identical to what a
diffusers user gets from `vae.enable_tiling(); vae.decode(z)`.

`enable_tiling` flips a switch on the model that every later decode reads; other threads decode
through the same model, so the switch is flipped on a view instead: a shallow copy that shares
every module and weight (no memory) and has a tiling switch of its own."""

from __future__ import annotations

import copy

from torch import nn


def tiled_view(vae: nn.Module) -> nn.Module | None:
    """The view, or None when the class has no tiled decode."""
    if not (hasattr(vae, "use_tiling") and callable(getattr(vae, "enable_tiling", None))):
        return None
    view = copy.copy(vae)  # a new __dict__: its own `use_tiling`; the same submodules and parameters
    view.enable_tiling()
    return view
