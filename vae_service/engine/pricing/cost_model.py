"""Where a request's cost is decided, from numbers fixed at start-up: its limits (items, frames,
pixels, FLOPs) and its peak memory per way of decoding it (whole in its tier, in spatial tiles, by
the class's own tiled decode). Pricing a request is constant work, except where a tier is priced
per shape (`needs_shape_work`: CPU Winograd's `high`, a frame count of a decoder without a frame
law, a class tiled decode the formula does not cover); the service runs those off the event loop
within the request's deadline.

Start-up (each probe once per architecture and process, models/probe_cache.py): each tier's graph
on the meta twin (engine/pricing/memory.py), the FLOP curve (engine/pricing/flops.py), the class tiled decode's fit
(engine/pricing/class_tiled_price.py); on CUDA each tier checked against real decodes
(engine/pricing/calibration.py); the memory bound (engine/pricing/memory_budget.py). An fp16/bf16
engine with the fp32 fallback on also prices the fallback's decodes (`fallback`: `lossless` and the
class's tiled decode at fp32, on a meta twin at fp32), so that they are planned within the bound
like any decode (engine/planning/planner.py's plan_fallback).

The peak of a whole decode: video converts and keeps frames while the decode goes on; an image is
decoded, then converted (its decoded pixels are in both phases), and `lossless` decodes its items
one by one, keeps them, then joins them. Beside all of it, the latents the decode holds (the twin
counts none: its input is made before it counts): the decoder input at the decode dtype, for
`high` and `preview` also the batch joined into one tensor (or a tile's input), and where the fp32
fallback runs its fp32 copy. A streamed request's answer is nothing, but the chunks handed over and
not yet read (at most `STREAM_CHUNKS_HELD`, serving/outputs/frame_stream.py) are held while the decode goes
on, in its memory where the device is not CUDA (on CUDA they are on the host).
"""

from __future__ import annotations

import functools
import threading

import torch

from vae_service.config import Limits
from vae_service.engine.pricing.calibration import calibrate_on_cuda
from vae_service.engine.pricing.class_tiled_price import ClassTiledPrice, class_tiled_codec, fit_class_tiled
from vae_service.engine.pricing.flops import FLOPS_CODEC, FlopModel, fit_flops
from vae_service.engine.pricing.memory import (
    FIT_CODEC,
    AffineTier,
    ModelFacts,
    PerShapeTier,
    TierPrice,
    TwinRun,
    fit_lines,
)
from vae_service.engine.pricing.memory_budget import MemoryBudget, memory_budget
from vae_service.engine.request.errors import LimitExceeded
from vae_service.engine.request.latents import PreparedRequest
from vae_service.engine.runtime.runtime import ChunkDecoder, Runtime
from vae_service.engine.runtime.tile_jobs import TileJob
from vae_service.fastpath import install_fast_path
from vae_service.fastpath.rewrites import NORM_REWRITES
from vae_service.models import ModelLoadError
from vae_service.models.diffusers_tiling import tiled_view
from vae_service.models.probe_cache import Architecture, ProbeCache, config_digest
from vae_service.models.probe_store import INTEGER
from vae_service.models.spec import dropped_parts, jsonable_config, meta_twin

# a stream's chunks handed over and not yet passed on by its reader: the stream's queue holds at
# most STREAM_CHUNKS_AHEAD (serving/outputs/frame_stream.py waits for room), and its reader one more
STREAM_CHUNKS_AHEAD = 4
STREAM_CHUNKS_HELD = STREAM_CHUNKS_AHEAD + 1
JOINED_TIERS = ("high", "preview")  # tiers whose batch decodes as one tensor (its latents joined)


class TwinChunks:
    """A tier's decode on the meta twin, as output chunks."""

    def __init__(self, runtime: Runtime, quality: str, folded=None):
        self.runtime, self.quality, self.folded = runtime, quality, folded

    def __call__(self, twin: torch.nn.Module, z: torch.Tensor):
        runtime = self.runtime
        if runtime.chunked:
            return ChunkDecoder(runtime, self.quality, runtime.probe_timestep, vae=twin, folded=self.folded)(z)
        return iter([runtime.pixels(twin, z, runtime.probe_timestep)])


class TwinWhole:
    """The class's own decode on the twin, the whole output at once (its tiled decode on a view).
    Holds no runtime: the class tiled price it makes outlives the engine in the process's probes."""

    def __init__(self, timestep: float | None):
        self.timestep = timestep

    def __call__(self, twin: torch.nn.Module, z: torch.Tensor):
        return iter([Runtime.pixels(twin, z, self.timestep)])


class RealChunks:
    """A tier's real decode on the device (CUDA calibration)."""

    def __init__(self, runtime: Runtime, quality: str):
        self.runtime, self.quality = runtime, quality

    def __call__(self, z: torch.Tensor):
        runtime = self.runtime
        with runtime.gate(self.quality):
            if runtime.chunked:
                yield from runtime.chunks(self.quality, runtime.probe_timestep)(z)
            else:
                yield runtime.image(z) if self.quality == "high" else runtime.pixels(runtime.vae, z)


class CostModel:
    def __init__(
        self, runtime: Runtime, disabled: tuple[str, ...], probes: ProbeCache | None = None, fallback_bytes: int = 0
    ):
        """`fallback_bytes`: the fp32 fallback's weights (engine/execution/fallback.py; 0 where it is
        off): reserved in the default bound, and its decodes priced at fp32 (`fallback`)."""
        probes = ProbeCache.process() if probes is None else probes  # an empty cache is falsy
        twin, lock = self._twin_prices(runtime, probes, runtime.dtype)
        self.flops: FlopModel = probes.get(
            self.architecture,
            "flops",
            lambda: fit_flops(twin, self.spec, TwinChunks(runtime, "lossless")),
            FLOPS_CODEC,
        )
        self.tiers["high"], folded = self.tiers["lossless"], 0
        if runtime.fast_path.installed:
            twin_fast = self._fast_twin(twin, disabled)
            gate = functools.partial(twin_fast.gate.use, True)
            high_run = TwinRun(twin, self.facts, TwinChunks(runtime, "high", twin_fast.folded), lock, gate)
            self.tiers["high"] = self._tier(high_run, probes, "high", warm=True)
            folded = probes.get(self.architecture, "folded", lambda: self._folded_bytes(high_run, twin_fast), INTEGER)
        if runtime.device.type == "cuda":
            for quality, tier in self.tiers.items():
                if quality == "lossless" or tier is not self.tiers["lossless"]:
                    calibrate_on_cuda(tier, RealChunks(runtime, quality), runtime.device)
        weights = sum(t.numel() * t.element_size() for t in (*runtime.vae.parameters(), *runtime.vae.buffers()))
        # fixed for the engine's life
        self.budget: MemoryBudget = memory_budget(runtime.device, weights, folded, fallback_bytes)
        # the fp32 fallback's own price: what the fp32 deployment charges for `lossless`
        self.fallback: CostModel | None = self._at_fp32() if fallback_bytes else None

    def _twin_prices(self, runtime: Runtime, probes: ProbeCache, dtype: torch.dtype):
        """The prices every cost model has, on a meta twin of the model at `dtype`: `lossless`, and
        the class's own tiled decode (fitted when first needed). Returns the twin and its lock."""
        self.runtime, self.spec, self._probes = runtime, runtime.spec, probes
        self.facts = ModelFacts.of(self.spec, dtype)
        twin = torch.nn.Module.to(meta_twin(runtime.vae), dtype=dtype).eval()
        rewrites = tuple(sorted(runtime.fast_path.plan.active.items())) if runtime.fast_path.installed else ()
        self.architecture = Architecture(
            type(runtime.vae),
            config_digest(jsonable_config(runtime.vae)),
            dropped_parts(runtime.vae),
            str(dtype),
            runtime.device.type,
            rewrites,
        )
        lock = threading.Lock()  # one twin, one fast-path gate: one run at a time
        lossless_run = TwinRun(twin, self.facts, TwinChunks(runtime, "lossless"), lock)
        self.tiers: dict[str, TierPrice] = {"lossless": self._tier(lossless_run, probes, "lossless")}
        # lossless above the bound: the class's own tiled decode, its price fitted when first needed
        # (a few seconds on the twin, that most deployments never spend)
        twin_tiled = tiled_view(twin)
        self.has_class_tiled = twin_tiled is not None
        self._fit_class_tiled = self._class_tiled_codec = None
        if twin_tiled is not None:
            tiled_run = TwinRun(twin_tiled, self.facts, TwinWhole(runtime.probe_timestep), lock)
            self._fit_class_tiled = functools.partial(fit_class_tiled, twin_tiled, tiled_run, self.spec)
            self._class_tiled_codec = class_tiled_codec(twin_tiled, tiled_run, self.spec)
        return twin, lock

    def _at_fp32(self) -> CostModel:
        """The fp32 fallback's price: `lossless` and the class's tiled decode at fp32, as the fp32
        deployment of this model prices them (the same graphs on a meta twin at fp32: no fp32 weights
        are loaded to price them). It has no bound of its own (the engine's) and no other tier. On
        CUDA it cannot be checked against real fp32 decodes before the fp32 copy exists: it takes
        the engine's own `lossless` calibration, scaled to fp32's bytes."""
        fp32 = object.__new__(CostModel)
        fp32._twin_prices(self.runtime, self._probes, torch.float32)
        fp32.flops, fp32.budget, fp32.fallback = self.flops, self.budget, None
        own = self.tiers["lossless"].correction
        if own is not None:
            ratio = fp32.facts.itemsize / self.facts.itemsize
            fp32.tiers["lossless"].correction = (own[0] * ratio, own[1] * ratio)
        return fp32

    @property
    def class_tiled(self) -> ClassTiledPrice | None:
        """The class tiled decode's price (fitted now if it was not: work that `needs_shape_work`
        sends off the event loop)."""
        if self._fit_class_tiled is None:
            return None
        return self._probes.get(self.architecture, "class tiled", self._fit_class_tiled, self._class_tiled_codec)

    @property
    def class_tiled_fitted(self) -> ClassTiledPrice | None:
        return self._probes.peek(self.architecture, "class tiled")

    def price_preview(self, tier: TierPrice) -> None:
        """The preview tier's price (engine/pricing/preview_price.py): the map's (or the
        tiny decoder's) working set on one latent frame of the whole batch, never calibrated here."""
        self.tiers["preview"] = tier

    def fit_lazy_prices(self) -> None:
        """Fit now what is otherwise fitted when first needed (a service does, beside start-up)."""
        _ = self.class_tiled
        if self.fallback is not None:
            self.fallback.fit_lazy_prices()

    def _fast_twin(self, twin: torch.nn.Module, disabled: tuple[str, ...]):
        """The twin with this engine's rewrites (the exact ones run in both tiers; Triton kernels stand
        in on meta by allocating their outputs)."""
        active = self.runtime.fast_path.plan.active
        norms = [backend for name, backend in active.items() if name in NORM_REWRITES]
        fast = install_fast_path(twin, disabled, norms[0] if norms else None, plan_device=self.runtime.device)
        if fast.plan.active != active or not fast.installed:
            raise ModelLoadError(f"fast path: its twin differs ({fast.skipped_because or fast.plan})")
        return fast

    @staticmethod
    def _folded_bytes(run: TwinRun, fast) -> int:
        if not fast.folded.nbytes:
            run.warm()
        return fast.folded.nbytes

    def _tier(self, run: TwinRun, probes: ProbeCache, quality: str, warm: bool = False) -> TierPrice:
        warmed = []

        def probe():
            if warm:
                run.warm()  # uncounted: builds the fast path's folded weights
                warmed.append(True)
            return fit_lines(run)

        lines, first, pixels = probes.get(self.architecture, f"memory {quality}", probe, FIT_CODEC)
        if lines is not None:
            return AffineTier(self.facts, lines)
        if warm and not warmed:  # this twin prices per shape: its folded weights first, uncounted
            run.warm()
        return PerShapeTier(run, first, pixels)

    # ---- limits ------------------------------------------------------------------------------
    def bound_frames(self, z: torch.Tensor, limits: Limits) -> None:
        """A count whose frames must be over max_frames is refused before any trace (a decoder
        without a frame law is traced per count, work that grows with the count)."""
        frames = self.spec.geometry.frames
        if z.dim() == 5 and frames is not None and frames.at_least(z.shape[2]) > limits.max_frames:
            raise LimitExceeded(
                "latents",
                f"{z.shape[2]} latent frames decode to at least {frames.at_least(z.shape[2])} frames per item, "
                f"over the limit of {limits.max_frames} (max_frames)",
            )

    def output_frames(self, z: torch.Tensor, limits: Limits) -> int:
        """Frames per item, checked against max_frames (bound_frames first)."""
        if z.dim() != 5:
            return 1
        self.bound_frames(z, limits)
        try:
            found = self.spec.output_frames(z.shape[2])
        except Exception as exc:  # an irregular frame law, traced for this count, and the trace failed
            raise LimitExceeded(
                "latents", f"model '{self.spec.name}' cannot decode {z.shape[2]} latent frames"
            ) from exc
        if found > limits.max_frames:
            raise LimitExceeded(
                "latents", f"decodes to {found} frames per item, over the limit of {limits.max_frames} (max_frames)"
            )
        return found

    def frames_need_trace(self, z: torch.Tensor) -> bool:
        frames = self.spec.geometry.frames
        return z.dim() == 5 and frames is not None and frames.needs_trace(z.shape[2])

    def check_limits(self, z: torch.Tensor, limits: Limits, frames: int) -> None:
        """Items, pixels and FLOPs (frames: output_frames), in constant time."""
        if z.shape[0] > limits.max_batch_items:
            raise LimitExceeded(
                "latents", f"batch of {z.shape[0]} is over the limit of {limits.max_batch_items} (max_batch_items)"
            )
        pixels = z.shape[0] * frames * z.shape[-2] * z.shape[-1] * self.spec.spatial_scale**2
        if pixels > limits.max_output_pixels:
            raise LimitExceeded(
                "latents",
                f"decodes to {pixels} pixels, over the limit of {limits.max_output_pixels} (max_output_pixels)",
            )
        tflop = self.tflop(z.shape[0], frames, *z.shape[-2:])
        if tflop > limits.max_decode_tflop:
            raise LimitExceeded(
                "latents",
                f"would cost about {tflop:.3g} TFLOP to decode, over the limit of "
                f"{limits.max_decode_tflop:g} (max_decode_tflop)",
            )

    def tflop(self, items: int, frames: int, h: int, w: int) -> float:
        return self.flops.tflop(items, frames, h, w)

    # ---- memory ------------------------------------------------------------------------------
    def bound(self, limits: Limits) -> int:
        """limits.max_decode_bytes, or the engine's fixed default (engine/pricing/memory_budget.py)."""
        return limits.max_decode_bytes if limits.max_decode_bytes is not None else self.budget.default_bound

    def needs_shape_work(self, prepared: PreparedRequest, limits: Limits) -> bool:
        """Whether pricing this request runs the twin (work that grows with the request): its own
        plan's price, or its fp32 fallback's (engine/planning/planner.py's plan_fallback)."""
        quality, bound = prepared.request.quality, self.bound(limits)
        if self._needs_shape_work(prepared, quality, bound):
            return True
        return (
            self.fallback is not None
            and quality != "preview"
            and self.fallback._needs_shape_work(prepared, "lossless", bound)
        )

    def _needs_shape_work(self, prepared: PreparedRequest, quality: str, bound: int) -> bool:
        items, (h, w) = prepared.items, prepared.latent_hw
        tier = self.tiers.get(quality)
        if tier is None:  # an engine without a preview price
            return False
        if tier.needs_shape_work(items if quality in JOINED_TIERS else 1, h, w):
            return True
        if quality != "lossless" or not self.has_class_tiled:
            return False
        if prepared.request.tiling != "model" and self.peak(prepared, quality) <= bound:
            return False  # only above the bound (or asked for) is the class's tiled decode priced
        fitted = self.class_tiled_fitted
        return fitted is None or fitted.needs_shape_work(h, w, prepared.latent_frames)

    def output_pixels(self, prepared: PreparedRequest, frames: int = 1) -> int:
        """Output pixels of `frames` frames of every item."""
        h, w = prepared.latent_hw
        return prepared.items * frames * h * w * self.facts.scale**2

    def answer_bytes(self, prepared: PreparedRequest) -> int:
        """What the answer holds while it is decoded (nothing for a streamed request)."""
        if prepared.request.stream:
            return 0
        return self.facts.answer(self.output_pixels(prepared, prepared.frames), prepared.request.output)

    def latent_bytes(self, prepared: PreparedRequest) -> int:
        """The request's decoder input at this model's decode dtype."""
        return prepared.latents.numel() * self.facts.itemsize

    def latents_held(self, prepared: PreparedRequest, quality: str | None = None) -> int:
        """The latents a decode of this request in `quality` holds throughout: its decoder input,
        and for tiers that decode their batch as one tensor, that joined copy (or a tile's input)."""
        quality = quality or prepared.request.quality
        return self.latent_bytes(prepared) * (2 if quality in JOINED_TIERS else 1)

    def streamed_bytes(self, prepared: PreparedRequest) -> int:
        """A stream's chunks handed over and not yet passed on (its queue's bound and the one its
        reader holds), held while the decode goes on; none where they are copied to the host (CUDA)
        or nothing is streamed."""
        if not prepared.request.stream or self.runtime.device.type == "cuda":
            return 0
        kept = 3 * (self.facts.itemsize if prepared.request.output == "float" else 1)
        chunks = min(STREAM_CHUNKS_HELD * self._chunk_pixels(prepared), self.output_pixels(prepared, prepared.frames))
        return chunks * kept

    def _chunk_pixels(self, prepared: PreparedRequest) -> int:
        """Output pixels of the largest chunk a video decode hands over at once."""
        facts = self.facts
        chunk_frames = prepared.frames if facts.per_latent_frame else min(prepared.frames, facts.chunk_frames)
        return self.output_pixels(prepared, chunk_frames)

    def held_beside_the_decode(self, prepared: PreparedRequest) -> int:
        """Video: the frames kept so far (or a stream's chunks not yet read), and the larger of the
        conversion of one chunk (its fp32 copy and uint8 pixels) and, chunk by chunk, the chunk
        before (the loop that handed it over still holds it while the next is decoded), all held
        while the decode goes on."""
        chunk = self._chunk_pixels(prepared)
        converting = 0 if prepared.request.output == "float" else chunk * (12 + 3)
        before = chunk * 3 * self.facts.itemsize if self.facts.chunked else 0
        return self.answer_bytes(prepared) + self.streamed_bytes(prepared) + max(converting, before)

    def held_while_tiled(self, prepared: PreparedRequest) -> int:
        """Beside one tile's decode: the blend's fp32 accumulator (video in lockstep: one chunk's;
        tile after tile's whole clip is counted by tile_for), what the answer holds, and the
        latents (the decoder input and a tile's)."""
        latents = self.latents_held(prepared, "high")
        if self.facts.video:
            chunk = self._chunk_pixels(prepared)
            converting = 0 if prepared.request.output == "float" else chunk * (12 + 3)
            return self.answer_bytes(prepared) + self.streamed_bytes(prepared) + converting + chunk * 12 + latents
        return self.answer_bytes(prepared) + self.output_pixels(prepared) * 12 + latents

    def peak(self, prepared: PreparedRequest, quality: str | None = None) -> int:
        """Estimated peak of decoding this request whole in its tier (or `quality`'s)."""
        quality = quality or prepared.request.quality
        (h, w), items, together = prepared.latent_hw, prepared.items, quality in JOINED_TIERS
        working = self.tiers[quality].working(items if together else 1, h, w, prepared.latent_frames)
        return self._with_answer(prepared, working, together) + self.latents_held(prepared, quality)

    def job_peak(self, job: TileJob) -> int | None:
        """A tile job's peak here, as a replica that takes another's tile prices it: the working set
        of its tier (the class's tiled decode's jobs: `lossless`'s) at the tile's shape, its output
        included. None where that shape would run the twin first (CPU Winograd): not on the event
        loop; the requester's plan, made by the same model and settings, prices it alike."""
        z = job.latents
        items, (h, w) = z.shape[0], z.shape[-2:]
        tier = self.tiers[self.runtime.job_tier(job)]
        if tier.needs_shape_work(items, h, w):
            return None
        return tier.working(items, h, w, z.shape[2] if z.dim() == 5 else 1)

    def class_tiled_peak(self, prepared: PreparedRequest, shared: bool = False) -> int:
        """Estimated peak of `lossless` by the class's own tiled decode, item by item; `shared`:
        with its decoder calls shared with replicas (the outputs they finished ahead of the blend
        held here meanwhile)."""
        h, w = prepared.latent_hw
        price = self.class_tiled.shared_working if shared else self.class_tiled.working
        working = price(h, w, prepared.latent_frames)
        return self._with_answer(prepared, working, together=False) + self.latents_held(prepared, "lossless")

    def _with_answer(self, prepared: PreparedRequest, working: int, together: bool) -> int:
        if self.facts.video:
            return working + self.held_beside_the_decode(prepared)
        answer = self.answer_bytes(prepared)
        if together:
            return max(working, answer)
        decoded_item = self.output_pixels(prepared) // prepared.items * 3 * self.facts.itemsize
        return max(working + (prepared.items - 1) * decoded_item, 2 * prepared.items * decoded_item, answer)

    def fallback_peak(self, prepared: PreparedRequest, tiled: bool) -> int:
        """Estimated peak of the fp32 fallback of this request's items (engine/execution/fallback.py),
        decoded again as `lossless` by its fp32 plan (`tiled`: the class's own tiled decode, else
        whole): the fp32 deployment's price of that decode (its fp32 latents included), which is
        what the executor holds (an image's items kept are copied to fp32 and its first pixels
        dropped first), beside this decode's own latents, and, for a video `float` answer, its
        frames at this precision, held while they are copied to fp32."""
        fp32 = self.fallback
        need = fp32.class_tiled_peak(prepared) if tiled else fp32.peak(prepared, "lossless")
        need += self.latents_held(prepared)
        if self.facts.video and prepared.request.output == "float":
            need += self.answer_bytes(prepared)
        return need

    def held_after_decode(self, prepared: PreparedRequest) -> int:
        """What this request holds once its decode is done, while another request of its run falls
        back: an image's decoded pixels (one tensor for the whole run) and its converted answer, a
        video's answer (and its stream's chunks not yet read), and its latents."""
        latents = self.latents_held(prepared)
        if self.facts.video:
            return self.answer_bytes(prepared) + self.streamed_bytes(prepared) + latents
        pixels, itemsize = self.output_pixels(prepared), self.facts.itemsize
        kept = pixels * 3 * (itemsize if prepared.request.output == "float" else 1)
        return pixels * 3 * itemsize + kept + latents

    def _describe_tiers(self) -> dict:
        tiers = {name: tier.describe() for name, tier in self.tiers.items()}
        if self.has_class_tiled:
            fitted = self.class_tiled_fitted
            tiers["lossless_tiled"] = fitted.describe() if fitted else {"priced": "fitted when first needed"}
        return tiers

    def describe(self, limits: Limits) -> dict:
        tiers = self._describe_tiers()
        # the fp32 fallback's decodes, planned within the same bound (engine/planning/planner.py)
        fallback = {"fallback_tiers_fp32": self.fallback._describe_tiers()} if self.fallback is not None else {}
        h = w = 128  # latent pixels: the FLOPs per pixel of a 1024 px image
        return {
            "decode_mflop_per_pixel": round(self.flops.mflop_per_output_pixel(h, w, self.facts.scale), 3),
            "memory_plan": {
                "decode_bound_bytes": self.bound(limits),
                "bound_from": "limits.max_decode_bytes" if limits.max_decode_bytes else "default",
                **self.budget.describe(),
                "tiers": tiers,
                **fallback,
            },
        }
