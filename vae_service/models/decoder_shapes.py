"""What a model's decoder answers, as empty meta tensors, without running it: its meta twin run
on the same input shapes (and, for a cached causal decoder, on a meta cache in the same state).
The record pass of models/diffusers_tiling.py answers the class's tiled decode with these: no
compute, no memory."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch
from torch import nn

from vae_service.models.spec import twin_of

FIRST_CHUNK = "first_chunk"  # the keyword Wan-style decoders take on a tile's first frame
# what a meta run of a class that cannot run on meta raises: the caller then decodes locally
META_ERRORS = (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError, AttributeError, KeyError)


class NoMetaShapes(Exception):
    """The decoder's outputs could not be shaped on the meta device."""


SHAPES_KEPT = 1024  # (input shape, cache state) answers kept per model: a few per tile shape


class DecoderShapes:
    """The decoder's outputs as empty meta tensors, from its meta twin (built once, on first use).
    One per model: its answers are kept here, per input shape and cache state (a tiled decode has
    a few tile shapes, and a tile's cache reaches a steady state after a few frames: the twin runs a
    few times per tile shape, not once per frame)."""

    def __init__(self, cls: type, config: dict, dtype: torch.dtype):
        self.cls, self.config, self.dtype = cls, config, dtype
        self._decoder: nn.Module | None = None
        self._answers: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, view: nn.Module) -> DecoderShapes | None:
        decoder = getattr(view, "decoder", None)
        dtype = next((p.dtype for p in decoder.parameters()), None) if isinstance(decoder, nn.Module) else None
        if dtype is None or not callable(getattr(view, "from_config", None)):
            return None
        return cls(type(view), json.loads(json.dumps(dict(view.config), default=str)), dtype)

    def _meta_decoder(self) -> nn.Module:
        if self._decoder is None:
            self._decoder = nn.Module.to(twin_of(self.cls, self.config), dtype=self.dtype).decoder
        return self._decoder

    def _answer(self, key: tuple, run):
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]
            found = run()
            self._answers[key] = found
            while len(self._answers) > SHAPES_KEPT:
                self._answers.popitem(last=False)
            return found

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """For a decoder called with one tensor."""

        def run():
            out = self._meta_decoder()(torch.empty(x.shape, dtype=x.dtype, device="meta"))
            if not isinstance(out, torch.Tensor):  # e.g. (output, cache)
                raise TypeError(f"{self.cls.__name__}'s decoder returns {type(out).__name__}")
            return out.shape, out.dtype

        try:
            shape, out_dtype = self._answer(("plain", tuple(x.shape), x.dtype), run)
        except META_ERRORS as exc:  # no meta run: decode locally
            raise NoMetaShapes from exc
        return torch.empty(shape, dtype=out_dtype, device="meta")

    def cached(self, x: torch.Tensor, first: bool | None, state: tuple) -> tuple[torch.Tensor, tuple, tuple]:
        """For one call of a cached decoder, from the state of its cache (`cache_state`): the output,
        the state the call leaves, and the cache and index it leaves (meta)."""

        def run():
            cache, idx = materialise(state), [0]
            kwargs = {"feat_cache": cache, "feat_idx": idx}
            if first is not None:
                kwargs[FIRST_CHUNK] = first
            out = self._meta_decoder()(torch.empty(x.shape, dtype=x.dtype, device="meta"), **kwargs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"{self.cls.__name__}'s decoder returns {type(out).__name__}")
            return out.shape, out.dtype, cache_state(cache), idx[0]

        try:
            shape, out_dtype, after, idx = self._answer(("cached", tuple(x.shape), x.dtype, first, state), run)
        except META_ERRORS as exc:
            raise NoMetaShapes from exc
        return torch.empty(shape, dtype=out_dtype, device="meta"), after, (materialise(after), idx)


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
