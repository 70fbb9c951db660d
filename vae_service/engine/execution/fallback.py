"""fp16/bf16 decodes whose output is not finite, decoded again in fp32.

Activations that overflow the decode precision are the most reported decode failure of image UIs
(SDXL's VAE in fp16; ComfyUI and AUTOMATIC1111 re-decode such latents in fp32). An engine decoding
in fp16 or bf16 answers an item whose output holds NaN/Inf with that item decoded by an fp32 copy
of its model, the way the fp32 deployment of the same model answers `lossless`: the same runtime
(engine/runtime/runtime.py) built at fp32 from the same source and seed, its latents scaled in fp32, and
its class's own decode, whole or by its class's own tiled decode as the request's fallback plan
says (engine/planning/planner.py's plan_fallback: what the fp32 deployment with the same
max_decode_bytes plans for it as `lossless`). So an item that fell back is bit-identical to that
deployment's `lossless` answer for it, and the answer says `tiled` when its fp32 plan tiled it.

That plan is priced like any decode (engine/pricing/cost_model.py's `fallback`: `lossless` and the
class's tiled decode at fp32, on a meta twin, no fp32 weights loaded to price them), and a request
is admitted only when it fits the bound too: an item that falls back stays within the bound its
first decode was planned for. The fp32 copy is loaded once, when the first item needs it (most
deployments never do). Its weights are reserved in the default bound from start-up whenever the
fallback is on (engine/pricing/memory_budget.py: a decode plan that fits before it is loaded still
fits after), and released on scale-down with the fast path's folded weights. Only an output that
fails the finite check the engine runs on every answer pays anything: a finite answer costs
nothing more.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from vae_service.config import ServiceConfig
from vae_service.engine.execution.call import DecodeCall, checked_chunks, decoder_hook
from vae_service.engine.request.latents import LatentScaling, PreparedRequest
from vae_service.engine.runtime.runtime import Runtime
from vae_service.engine.runtime.wan_walk import Walk
from vae_service.models.diffusers_tiling import tiled_view

FALLBACK_PRECISION = "fp32"


class Fp32Fallback:
    def __init__(self, config: ServiceConfig, runtime):
        self.config, self.runtime = config, runtime
        self.needed = runtime.dtype != torch.float32  # an fp32 deployment has nothing to fall back to
        self.enabled = self.needed and config.precision_fallback
        # what the fp32 copy will hold, reserved in the memory plan while the fallback is on
        self.weight_bytes = sum(t.numel() * 4 for t in _floating(runtime.vae)) if self.enabled else 0
        self._fp32 = None  # Runtime at fp32, loaded by the first item that needs it
        self._scaling: LatentScaling | None = None
        self._lock = threading.Lock()  # replicas' tile threads and the device thread may both need it
        self.items = 0  # items answered by the fallback since start-up

    @property
    def loaded(self) -> bool:
        return self._fp32 is not None

    def _runtime(self):
        with self._lock:
            if self._fp32 is None:
                fp32 = Runtime(self.config.model_copy(update={"decode_precision": FALLBACK_PRECISION}))
                # the checkpoint of the call running on this thread, as for the engine's own decoder
                getattr(fp32.vae, "decoder", fp32.vae).register_forward_pre_hook(decoder_hook(fp32.chunked))
                self._scaling, self._fp32 = fp32.scaling, fp32
            return self._fp32

    def latents(self, prepared: PreparedRequest) -> torch.Tensor:
        """The request's decoder input as the fp32 deployment scales it."""
        fp32 = self._runtime()
        return self._scaling.to_decoder_input(prepared, fp32.device)

    def image(self, z: torch.Tensor, timestep: float | None, tiled: bool) -> torch.Tensor:
        """One item's fp32 `lossless` decode: its class's own decode, or (`tiled`, as its fallback
        plan says) its tiled decode."""
        fp32 = self._runtime()
        view = _tiled_decode(fp32, tiled)
        with fp32.gate("lossless"):
            return fp32.each_alone(fp32.vae if view is None else view, z, timestep)

    def images(self, held: list, prepared: PreparedRequest, tiled: bool) -> tuple[list[int], torch.Tensor | None]:
        """A request's decoded images with every item that is not finite decoded again in fp32 by
        the request's fp32 plan (`tiled`: the class's own tiled decode, else whole), all of it fp32
        now (exact for the others): the items decoded again, and the pixels (None when not even
        fp32 gives finite ones). Within the fp32 plan's price: the items kept are copied to fp32
        and the first decode's pixels dropped (taken out of `held`, the caller's only reference)
        before any item is decoded again, as the fp32 deployment holds the items it decoded before."""
        decoded = held.pop()
        finite = [bool(torch.isfinite(item).all()) for item in decoded.split(1)]
        items = [decoded[k : k + 1].float() if ok else None for k, ok in enumerate(finite)]
        del decoded
        again = [k for k, ok in enumerate(finite) if not ok]
        z = self.latents(prepared)
        for k in again:
            item = self.image(z[k : k + 1], prepared.timestep, tiled)
            if not bool(torch.isfinite(item).all()):
                return again, None
            items[k] = item
        self.items += len(again)
        return again, torch.cat(items)

    def chunks(self, z: torch.Tensor, timestep: float | None, tiled: bool) -> Iterator[torch.Tensor]:
        """One video item's fp32 `lossless` decode, chunk by chunk as the fp32 deployment hands
        them over (`tiled`, as its fallback plan says: the class's tiled decode, the whole clip at
        once)."""
        fp32 = self._runtime()
        view = _tiled_decode(fp32, tiled)
        with fp32.gate("lossless"):
            if view is not None:
                yield fp32.each_alone(view, z, timestep)
                return
            yield from checked_chunks(fp32.chunks("lossless", timestep)(z))

    def session_runtime(self) -> Runtime:
        """The fp32 copy, for a decode session that fell back (engine/execution/session.py)."""
        return self._runtime()

    def session_walk(self, walk: Walk) -> Walk:
        """A session's walk continued at fp32: its causal cache (finite: the chunks before decoded
        finite) cast to fp32, on the fp32 copy's modules of the same names. The frames it gives are
        fp32 decodes of the session's next latents from that cache: not any single decode's bits,
        which would need every latent since the first again."""
        fp32 = self._runtime()
        own = {m: name for name, m in walk.d.named_modules()}
        theirs = dict(fp32.vae.decoder.named_modules())
        moved = walk.fork()
        moved.d, moved.options, moved.folded = fp32.vae.decoder, fp32.walks["lossless"], fp32.fast_path.folded
        moved.format = torch.contiguous_format
        moved.history = {theirs[own[conv]]: t.float().contiguous() for conv, t in walk.history.items()}
        moved.started_upsamplers = {theirs[own[m]] for m in walk.started_upsamplers}
        return moved

    def release(self) -> int:
        """Drop the fp32 copy (loaded again by the next item that needs it); bytes freed."""
        with self._lock:
            if self._fp32 is None:
                return 0
            freed = sum(t.numel() * t.element_size() for t in _floating(self._fp32.vae))
            self._fp32 = self._scaling = None
        self.runtime.release_device_cache()
        return freed

    def describe(self) -> dict:
        if not self.needed:
            return {"enabled": False, "why": "this deployment decodes in fp32"}
        return {
            "enabled": self.enabled,
            "to": FALLBACK_PRECISION,
            "loaded": self.loaded,
            "reserved_bytes": self.weight_bytes,
            "items": self.items,
        }


def tiled_after_fallback(call: DecodeCall, i: int, prepared: PreparedRequest, fell_back: list[int], tiled: bool):
    """Request i's `tiled` once `fell_back` items were decoded again in fp32 (`tiled`: by the class's
    own tiled decode): tiled when any pixel of the answer came from tiles. An answer whose every
    item fell back holds no pixel of the first decode, unless a stream sent some already."""
    if tiled:
        call.tiled.add(i)
    elif len(fell_back) == prepared.items and prepared.sink is None:
        call.tiled.discard(i)


def _tiled_decode(fp32, tiled: bool) -> torch.nn.Module | None:
    """The class's own tiled decode where the fallback plan tiles; None: its whole decode."""
    return tiled_view(fp32.vae) if tiled else None


def _floating(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
