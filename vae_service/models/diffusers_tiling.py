"""A model as `vae.enable_tiling()` leaves it, for `lossless` decodes above the memory bound: the
class's own tiled decode with its default tile settings, so the answer is bit-identical to what a
diffusers user gets from `vae.enable_tiling(); vae.decode(z)`; and that tiled decode with its
decoder calls made elsewhere (other replicas), still bit for bit (`tiled_decode_elsewhere`).

`enable_tiling` flips a switch on the model that every later decode reads; other threads decode
through the same model, so the switch is flipped on a view instead: a shallow copy that shares
every module and weight (no memory) and has a tiling switch of its own.

`tiled_decode_elsewhere` runs the class's own tiled decode twice, so that diffusers' code does the
tiling and the blending both times: pass 1 records the decoder's inputs (the decoder answers meta
tensors shaped like its outputs: no compute, no memory), the recorded inputs are decoded elsewhere
(the engine's tile executor: `DecoderInput` and `CausalTile` jobs), and pass 2 replays the decode
with those outputs in place of the decoder's, checking that each input is the one recorded. Measured
(docs/performance.md, "Lossless above the bound"): on an SD-sized decoder the record and the replay
cost nothing measurable beside the decoder calls (96% of the decode), so two replicas approach 2x.

Every diffusers internal this reads, checked on each loaded model by `replay_unsupported_because`
(a model that fails a check decodes its tiles where the request is, never differently); pyproject.toml
bounds diffusers to the releases these were read from (0.35-0.42), and another release turns the
replay off (`DIFFUSERS_CHECKED`):
- `enable_tiling()` and `tiled_decode` on the class; the switch it sets lives in the instance's
  `__dict__` (a shallow copy has its own);
- the decoder is the `decoder` submodule, in `_modules` (a shallow copy of that dict swaps it for
  one call), called with the decoder input alone, or, for cached causal decoders (Wan,
  Qwen-Image), once per latent frame with `feat_cache`, `feat_idx=[0]` and, where its forward takes
  it, `first_chunk` on the tile's first frame;
- `clear_cache()` makes `_feat_map`, one None per causal conv of the decoder, counting the
  `encoder`'s convs too where there is one (the service drops it: an empty module counts none);
- `from_config` and `config` build the meta twin that shapes the decoder's outputs
  (models/decoder_shapes.py);
- the classes whose tiled decode was checked to replay bit for bit (`REPLAYED_CLASSES`,
  tests/unit/test_diffusers_tiling.py): their decoder keeps no state between calls but the cache it
  is handed. Others decode their tiles where the request is (Magvit's convs keep features on the
  modules, Allegro copies the decoder's outputs into a buffer of its own, LTX and CogVideoX pass a
  timestep or a cache).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import diffusers
import torch
from torch import nn

from vae_service.models.decoder_shapes import (
    FIRST_CHUNK,
    META_ERRORS,
    DecoderShapes,
    NoMetaShapes,
)

REPLAYED_CLASSES = frozenset(
    {
        "AutoencoderKL",
        "AutoencoderKLFlux2",
        "AutoencoderDC",
        "AutoencoderKLKVAE",
        "AutoencoderKLHunyuanImage",
        "AutoencoderKLHunyuanVideo",
        "AutoencoderKLWan",
        "AutoencoderKLQwenImage",
    }
)
DIFFUSERS_CHECKED = ((0, 35), (0, 43))  # releases read: from the first, up to (not including) the second

_CACHE_KWARGS = ("feat_cache", "feat_idx")  # how Wan-style classes pass their decoder its cache

BLENDS = ("blend_v", "blend_h", "blend_t")  # the classes' blending methods, called once per tile edge


def tiled_view(vae: nn.Module) -> nn.Module | None:
    """The view, or None when the class has no tiled decode (some classes have the switch, but
    no decode reads it)."""
    if not all(callable(getattr(vae, name, None)) for name in ("enable_tiling", "tiled_decode")):
        return None
    view = copy.copy(vae)  # a new __dict__: its own `use_tiling`; the same submodules and parameters
    if getattr(vae, "encoder", False) is None:
        # the service drops the encoder, and causal video classes count its convs whenever they
        # reset their decode cache: an empty one counts none (copy.copy shares `_modules`)
        view.__dict__["_modules"] = vae._modules.copy()
        view.encoder = nn.Module()
    view.enable_tiling()
    return view


def replay_unsupported_because(vae: nn.Module) -> list[str]:
    """Why `tiled_decode_elsewhere` would not replay this model's tiled decode (empty: it does),
    from the internals listed above; the engine then decodes its tiles where the request is."""
    reasons = []
    version = _release(diffusers.__version__)
    low, high = DIFFUSERS_CHECKED
    if not low <= version < high:
        reasons.append(f"diffusers {diffusers.__version__} is not a release its internals were read from")
    if not any(cls.__name__ in REPLAYED_CLASSES for cls in type(vae).__mro__):
        reasons.append(f"{type(vae).__name__}'s tiled decode was not checked to replay bit for bit")
    view = tiled_view(vae) if isinstance(getattr(vae, "_modules", None), dict) else None
    if view is None:
        reasons.append("no enable_tiling() and tiled_decode")
    elif view.__dict__.get("use_tiling") is not True or getattr(vae, "use_tiling", False):
        reasons.append("enable_tiling() does not set `use_tiling` on the instance alone")
    if not isinstance(getattr(vae, "decoder", None), nn.Module) or "decoder" not in vae._modules:
        reasons.append("no `decoder` submodule")
    if not callable(getattr(vae, "from_config", None)):
        reasons.append("no from_config (the meta twin that shapes the decoder's outputs)")
    return reasons


def _release(version: str) -> tuple[int, int]:
    major, minor = [*version.split("."), "0"][:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def decode_causal_tile(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """One tile of a cached causal video decoder's own tiled decode (Wan, Qwen-Image), decoded by
    `vae` as the class decodes a tile: `z` is the tile's decoder inputs of every latent frame
    ([B, C, T, h, w]); a fresh feature cache (as its `clear_cache` makes it), then frame by frame
    with `feat_idx=[0]` and, where its decoder takes it, `first_chunk=(k == 0)`; the frames'
    outputs concatenated along time. Run it as a decode (e.g. in `torch.inference_mode()`).

    Raises ValueError on a model without a cached causal decoder, or a `z` that is not a tile."""
    causal = _causal(vae)
    if causal is None:
        raise ValueError(
            f"a causal tile: {type(vae).__name__} has no cached causal decoder (a `clear_cache` that "
            "makes a `_feat_map` of None, and a decoder that takes `feat_cache` and `feat_idx`)"
        )
    if z.dim() != 5 or z.shape[2] == 0:
        raise ValueError(f"a causal tile is [B, C, T, h, w] with T > 0, not {tuple(z.shape)}")
    cache: list = [None] * causal.size
    frames = []
    for k in range(z.shape[2]):
        kwargs = {"feat_cache": cache, "feat_idx": [0]}
        if causal.first_chunk:
            kwargs[FIRST_CHUNK] = k == 0
        # contiguous: diffusers passes each frame fresh from its post_quant_conv
        frames.append(vae.decoder(z[:, :, k : k + 1].contiguous(), **kwargs))
    return torch.cat(frames, 2)


def tiled_decode_elsewhere(
    view: nn.Module,
    z: torch.Tensor,
    decode_jobs: Callable[[list[torch.Tensor], bool], Iterable[torch.Tensor]],
    checkpoint: Callable[[], None] | None = None,
    shapes: DecoderShapes | None = None,
) -> torch.Tensor | None:
    """`view.decode(z).sample` (`view`: a `tiled_view`; `z`: one item of decoder-input latents),
    bit for bit, with every call of its decoder made by `decode_jobs(jobs, causal)`: all the jobs
    at once, in call order; it answers, for each in the same order, `model.decoder(job)` (causal
    False: a job is one decoder input) or `decode_causal_tile(model, job)` (causal True: cached
    causal video decoders, Wan and Qwen-Image, one spatial tile's inputs of every latent frame), of
    the same shape, dtype and device, taken one at a time as the blend reaches them (diffusers
    blends into them in place, so each must be a tensor of its own). `checkpoint` runs before each
    decoder call of the record and of the replay (the real decoder's forward pre-hooks do not run):
    a scheduler may run other decodes there (recording a large image's tiles takes a while too).

    None, having called nothing: the class's tiled decode calls its decoder in a way the replay
    does not cover (other arguments, e.g. timestep conditioning; a cache other than Wan's), or on
    fewer than two tiles (no tiling at this size), or its outputs cannot be shaped on the meta
    device; the caller decodes `view.decode(z)`. Raises RuntimeError when `decode_jobs` answers
    the wrong number of tensors or one unlike the decoder's, or when the replay's decoder calls
    differ from the recorded ones."""
    if not any(cls.__name__ in REPLAYED_CLASSES for cls in type(view).__mro__):
        return None
    shapes = shapes or DecoderShapes.of(view)  # the caller's, kept per model (else made for this call)
    if shapes is None:
        return None
    recorder = _Recorder(shapes, view, checkpoint)
    try:
        # its shape alone: the record's meta tensors are not held through the replay (_Light)
        planned = _with_decoder(view, recorder, checkpoint).decode(z).sample.shape
        plan = recorder.plan()
    except (_Unsupported, NoMetaShapes, *META_ERRORS):  # e.g. a tiled decode that copies the meta outputs
        return None
    if len(plan.jobs) < 2:
        return None
    outputs = iter(decode_jobs(list(plan.jobs), plan.causal))
    replayer = _Replayer(plan, outputs, checkpoint, view.decoder)
    decoded = _with_decoder(view, replayer, checkpoint).decode(z).sample
    n = len(plan.calls)
    if replayer.calls != n:
        raise RuntimeError(f"tiled decode: the replay called the decoder {replayer.calls} times, the record {n}")
    if next(outputs, None) is not None:
        raise RuntimeError(f"decode_jobs answered more than the {len(plan.jobs)} {plan.noun} it was given")
    if decoded.shape != planned:
        raise RuntimeError(
            f"tiled decode: the replay's output is {tuple(decoded.shape)}, the record's {tuple(planned)}"
        )
    return decoded


class _Unsupported(Exception):
    """A decoder call the replay does not cover: stops pass 1 (the caller decodes locally)."""


@dataclass(frozen=True)
class _Causal:
    """How a cached causal decoder is called: its cache's length, and whether it takes `first_chunk`."""

    size: int
    first_chunk: bool


def _causal(vae: nn.Module) -> _Causal | None:
    """The class's decoder cache as its `clear_cache` makes it (Wan and Qwen-Image: one None per
    causal conv of the decoder), None when it has none."""
    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, nn.Module) or not callable(getattr(vae, "clear_cache", None)):
        return None
    try:
        params = inspect.signature(decoder.forward).parameters
    except (TypeError, ValueError):
        return None
    if not all(name in params for name in _CACHE_KWARGS):
        return None
    probe = copy.copy(vae)  # clear_cache sets attributes: on a probe, not on a model others decode with
    probe.__dict__["_modules"] = vae._modules.copy()
    if getattr(vae, "encoder", False) is None:
        probe.encoder = nn.Module()  # Qwen-Image counts its encoder's convs too
    try:
        probe.clear_cache()
    except META_ERRORS:
        return None
    cache = probe.__dict__.get("_feat_map")
    if type(cache) is not list or not cache or not _fresh(cache):
        return None
    return _Causal(len(cache), FIRST_CHUNK in params)


def _fresh(cache: list) -> bool:
    return all(entry is None for entry in cache)


@dataclass(frozen=True)
class _Like:
    """A tensor's shape and dtype: what the record keeps of the decoder's meta answers. Meta tensors
    hold no memory, but a byte count of live tensors (the price's, the conformance suite's) counts
    their storage like any other's: the record keeps none of them through the replay."""

    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Like:
        return cls(t.shape, t.dtype)


def _light(entries: Iterable) -> list:
    """A meta cache's entries with the same shapes and dtypes on storage of one element each
    (expanded): what the class's tiled decode is left holding between decoder calls, the cache
    being read by the decoder alone (the replay's, which reads only whether it is fresh)."""
    return [
        torch.empty((), dtype=e.dtype, device="meta").expand(e.shape) if isinstance(e, torch.Tensor) else e
        for e in entries
    ]


@dataclass
class _Call:
    """One recorded decoder call."""

    job: int  # the job it is part of
    frame: int  # its input's frame in the job (cached; 0 otherwise)
    start: bool  # the job's first call
    out: _Like  # what the decoder answers
    out_from: int = 0  # where its output starts in the job's (time; cached)
    first: bool | None = None  # the `first_chunk` it was given (cached, where the decoder takes it)
    after: tuple | None = None  # the cache and index the decoder leaves (cached; its tensors `_light`)


@dataclass
class _Plan:
    causal: bool  # jobs are whole causal tiles (else single decoder inputs)
    calls: list[_Call]
    jobs: list[torch.Tensor]  # what decode_jobs decodes
    answers: list[_Like]  # what it answers for each
    keywords: frozenset[str]

    @property
    def noun(self) -> str:
        return "tiles" if self.causal else "decoder inputs"


class _Recorder(nn.Module):
    """Pass 1's decoder."""

    def __init__(self, shapes: DecoderShapes, view: nn.Module, checkpoint: Callable[[], None] | None = None):
        super().__init__()
        self.checkpoint = checkpoint
        # the real decoder, as a submodule: some classes count its convs when they reset their cache
        self.real = view.decoder
        self.shapes = shapes
        self.causal_of = lambda: _causal(view)  # not the view itself: a submodule, it would be counted
        self.cached: bool | None = None  # its calls pass a cache (set by the first call)
        self.calls: list[_Call] = []
        self.inputs: list[list[torch.Tensor]] = []  # each job's, in order
        self.causal: _Causal | None = None
        self.keywords: frozenset[str] = frozenset()
        self.cache: list | None = None  # the current tile's
        self.state: tuple = ()  # the current tile's cache, as its meta twin has it (_state)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.checkpoint is not None:
            self.checkpoint()
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise _Unsupported
        (x,) = args
        cached = bool(kwargs)
        if self.cached not in (None, cached):
            raise _Unsupported
        self.cached = cached
        # a clone: tiles are often views of z, and they are sent elsewhere
        clone = x.clone(memory_format=torch.contiguous_format)
        if not cached:
            out = self.shapes.plain(x)
            self.calls.append(_Call(len(self.inputs), 0, True, _Like.of(out)))
            self.inputs.append([clone])
            return out
        call, out = self._cached(x, kwargs)
        self.calls.append(call)
        self.inputs[call.job].append(clone)
        return out

    def _cached(self, x: torch.Tensor, kwargs: dict) -> tuple[_Call, torch.Tensor]:
        if self.causal is None:
            self.causal = self.causal_of()
            if self.causal is None:
                raise _Unsupported
            self.keywords = frozenset((*_CACHE_KWARGS, FIRST_CHUNK) if self.causal.first_chunk else _CACHE_KWARGS)
        cache, idx = kwargs.get("feat_cache"), kwargs.get("feat_idx")
        if set(kwargs) != self.keywords or type(cache) is not list or type(idx) is not list or idx != [0]:
            raise _Unsupported
        if x.dim() != 5 or x.shape[2] != 1:  # one latent frame a call
            raise _Unsupported
        start = _fresh(cache)  # a tile's first call (after the class's clear_cache)
        if start:
            if len(cache) != self.causal.size:
                raise _Unsupported
            self.cache, self.state = cache, (None,) * len(cache)
            self.inputs.append([])
        elif cache is not self.cache:
            raise _Unsupported
        first = kwargs.get(FIRST_CHUNK)
        if self.causal.first_chunk and (type(first) is not bool or first != start):
            raise _Unsupported  # not what decode_causal_tile passes
        out, self.state, (entries, at) = self.shapes.cached(x, first, self.state)
        after = (_light(entries), at)
        _leave(cache, idx, after)  # as the decoder would: the next call sees the tile's cache
        job = len(self.inputs) - 1
        return _Call(job, len(self.inputs[job]), start, _Like.of(out), first=first, after=after), out

    def plan(self) -> _Plan:
        if self.cached is None:
            return _Plan(False, [], [], [], frozenset())
        if not self.cached:
            jobs, answers = [xs[0] for xs in self.inputs], [call.out for call in self.calls]
        else:
            if any(x.shape[:2] != xs[0].shape[:2] or x.shape[3:] != xs[0].shape[3:] for xs in self.inputs for x in xs):
                raise _Unsupported  # one cache across tiles of different shapes: not a tile
            jobs = [torch.cat(xs, 2) for xs in self.inputs]
            answers = []
            for job in range(len(jobs)):
                calls = [call for call in self.calls if call.job == job]
                at = 0
                for call in calls:
                    call.out_from, at = at, at + call.out.shape[2]
                answers.append(_joined([call.out for call in calls]))
        self.inputs.clear()
        return _Plan(self.cached, self.calls, jobs, answers, self.keywords)


def _joined(outs: list[_Like]) -> _Like:
    """The outputs of one tile's calls joined along time (as torch.cat would have them)."""
    first = outs[0]
    if any(o.dtype != first.dtype or len(o.shape) != len(first.shape) or len(first.shape) < 3 for o in outs):
        raise _Unsupported
    if any(o.shape[:2] != first.shape[:2] or o.shape[3:] != first.shape[3:] for o in outs):
        raise _Unsupported
    return _Like(torch.Size((*first.shape[:2], sum(o.shape[2] for o in outs), *first.shape[3:])), first.dtype)


def _leave(cache: list, idx: list, after: tuple) -> None:
    cache[:], idx[0] = after


class _Replayer(nn.Module):
    """Pass 2's decoder: the outputs decoded elsewhere, in order, for the inputs pass 1 recorded."""

    def __init__(
        self,
        plan: _Plan,
        outputs: Iterator[torch.Tensor],
        checkpoint: Callable[[], None] | None,
        decoder: nn.Module,
    ):
        super().__init__()
        self.real = decoder  # as in _Recorder
        self.plan, self.outputs, self.checkpoint = plan, outputs, checkpoint
        self.calls = 0
        self.answer: torch.Tensor | None = None  # the current job's
        self.cache: list | None = None  # the current tile's

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.checkpoint is not None:
            self.checkpoint()
        plan = self.plan
        k, n = self.calls, len(plan.calls)
        self.calls += 1
        if k >= n or len(args) != 1 or not self._as_recorded(plan.calls[k], kwargs):
            raise RuntimeError(f"tiled decode: the replay's decoder call {k} is not one of the {n} recorded")
        call, (x,) = plan.calls[k], args
        recorded = plan.jobs[call.job]
        if plan.causal:
            recorded = recorded[:, :, call.frame : call.frame + 1]
        if not _same(x, recorded):
            raise RuntimeError(f"tiled decode: the replay's decoder input {k} of {n} differs from the recorded one")
        if call.start:
            self.answer = self._answer(call.job, x.device)
        if not plan.causal:
            return self.answer
        _leave(kwargs["feat_cache"], kwargs["feat_idx"], call.after)
        return self.answer[:, :, call.out_from : call.out_from + call.out.shape[2]]

    def _as_recorded(self, call: _Call, kwargs: dict) -> bool:
        if not self.plan.causal:
            return not kwargs
        cache, idx = kwargs.get("feat_cache"), kwargs.get("feat_idx")
        if set(kwargs) != self.plan.keywords or type(cache) is not list or type(idx) is not list or idx != [0]:
            return False
        if _fresh(cache) != call.start or kwargs.get(FIRST_CHUNK) != call.first:
            return False
        if not call.start and cache is not self.cache:
            return False
        self.cache = cache
        return True

    def _answer(self, j: int, device: torch.device) -> torch.Tensor:
        count = len(self.plan.jobs)
        out = next(self.outputs, None)
        if out is None:
            raise RuntimeError(f"decode_jobs answered {j} tensors for {count} {self.plan.noun}")
        like = self.plan.answers[j]
        if not (
            isinstance(out, torch.Tensor)
            and out.shape == like.shape
            and out.dtype == like.dtype
            and out.device == device
        ):
            got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
            want = f"{tuple(like.shape)} {like.dtype} on {device}"
            raise RuntimeError(f"decode_jobs' output {j} of {count} is {got}, the decoder's would be {want}")
        return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    # NaN reaching the decoder (an overflow at low precision) is not a bug: the engine rejects the output
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _with_decoder(view: nn.Module, decoder: nn.Module, checkpoint: Callable[[], None] | None = None) -> nn.Module:
    """A view of `view` for one call, with `decoder` in place of its decoder (and `checkpoint` run
    before each of its blends: the blend of a large image is many small ops, a while on the host)."""
    call_view = copy.copy(view)
    # copy.copy shares the `_modules` dict: swapping the decoder in it would swap every thread's
    call_view.__dict__["_modules"] = view._modules.copy()
    call_view.decoder = decoder
    if checkpoint is not None:
        for name in BLENDS:
            # bound to `view`, not to the call's view: no cycle keeps the call's decoder (a replay's
            # outputs) alive past the call
            blend = getattr(view, name, None)
            if callable(blend):
                call_view.__dict__[name] = _checked(blend, checkpoint)
    return call_view


def _checked(blend: Callable, checkpoint: Callable[[], None]) -> Callable:
    def checked(*args, **kwargs):
        checkpoint()
        return blend(*args, **kwargs)

    return checked
