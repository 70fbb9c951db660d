"""What a model's decoder answers, as empty meta tensors, without running it: its meta twin run
on the same input shapes (and, for a cached causal decoder, on a meta cache in the same state).
The record pass of models/diffusers_tiling.py answers the class's tiled decode with these: no
compute, no memory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from vae_service.models.spec import twin_of

FIRST_CHUNK = "first_chunk"  # the keyword Wan-style decoders take on a tile's first frame
# what a meta run of a class that cannot run on meta raises: the caller then decodes locally
META_ERRORS = (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError, AttributeError, KeyError)


class NoMetaShapes(Exception):
    """The decoder's outputs could not be shaped on the meta device."""


@dataclass(frozen=True)
class DecoderShapes:
    """The decoder's outputs as empty meta tensors, from its meta twin."""

    cls: type
    config: str
    dtype: torch.dtype

    @classmethod
    def of(cls, view: nn.Module) -> DecoderShapes | None:
        decoder = getattr(view, "decoder", None)
        dtype = next((p.dtype for p in decoder.parameters()), None) if isinstance(decoder, nn.Module) else None
        if dtype is None or not callable(getattr(view, "from_config", None)):
            return None
        return cls(type(view), json.dumps(dict(view.config), sort_keys=True, default=str), dtype)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """For a decoder called with one tensor."""
        try:
            shape, out_dtype = _meta_output(self.cls, self.config, self.dtype, tuple(x.shape), x.dtype)
        except META_ERRORS as exc:  # no meta run: decode locally
            raise NoMetaShapes from exc
        return torch.empty(shape, dtype=out_dtype, device="meta")

    def cached(self, x: torch.Tensor, first: bool | None, state: tuple) -> tuple[torch.Tensor, tuple, tuple]:
        """For one call of a cached decoder, from the state of its cache (`cache_state`): the output,
        the state the call leaves, and the cache and index it leaves (meta)."""
        try:
            shape, out_dtype, after, idx = _meta_step(
                self.cls, self.config, self.dtype, (tuple(x.shape), x.dtype), first, state
            )
        except META_ERRORS as exc:
            raise NoMetaShapes from exc
        return torch.empty(shape, dtype=out_dtype, device="meta"), after, (materialise(after), idx)


@lru_cache(maxsize=256)
def _meta_output(
    cls: type, config: str, dtype: torch.dtype, shape: tuple[int, ...], in_dtype: torch.dtype
) -> tuple[torch.Size, torch.dtype]:
    """The decoder's output shape and dtype for one input shape (a tiled decode has a few: inner,
    edge and corner tiles), from its meta twin."""
    out = _meta_decoder(cls, config, dtype)(torch.empty(shape, dtype=in_dtype, device="meta"))
    if not isinstance(out, torch.Tensor):  # e.g. (output, cache)
        raise TypeError(f"{cls.__name__}'s decoder returns {type(out).__name__}")
    return out.shape, out.dtype


@lru_cache(maxsize=1024)
def _meta_step(
    cls: type, config: str, dtype: torch.dtype, x: tuple, first: bool | None, state: tuple
) -> tuple[torch.Size, torch.dtype, tuple, int]:
    """A cached decoder's output shape and dtype for an input (`x`: shape and dtype) and a cache
    in `state`, and the state and index it leaves: its meta twin run on a meta cache. Shapes
    depend on nothing else, and a tile's cache reaches a steady state after a few frames (it keeps
    the last ones), so the twin runs a few times per tile shape, not once per frame."""
    cache, idx = materialise(state), [0]
    kwargs = {"feat_cache": cache, "feat_idx": idx}
    if first is not None:
        kwargs[FIRST_CHUNK] = first
    out = _meta_decoder(cls, config, dtype)(torch.empty(x[0], dtype=x[1], device="meta"), **kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{cls.__name__}'s decoder returns {type(out).__name__}")
    return out.shape, out.dtype, cache_state(cache), idx[0]


def cache_state(cache: list) -> tuple:
    """A cache as far as shapes go: each entry's shape, strides and dtype, or the entry (None,
    a marker such as Wan's "Rep")."""
    state = []
    for entry in cache:
        if isinstance(entry, torch.Tensor):
            state.append((tuple(entry.shape), entry.stride(), entry.dtype))
        elif entry is None or isinstance(entry, (str, int, float)):
            state.append(entry)
        else:
            raise TypeError(f"a decoder cache entry of type {type(entry).__name__}")
    return tuple(state)


def materialise(state: tuple) -> list:
    return [torch.empty_strided(*e[:2], dtype=e[2], device="meta") if isinstance(e, tuple) else e for e in state]


@lru_cache(maxsize=8)
def _meta_decoder(cls: type, config: str, dtype: torch.dtype) -> nn.Module:
    return nn.Module.to(twin_of(cls, json.loads(config)), dtype=dtype).decoder
