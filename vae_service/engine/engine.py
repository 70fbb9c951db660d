"""DecodeEngine: one VAE on one device at one precision, fixed for its lifetime; decodes
homogeneous batches.

Tier decisions live here and only here:
- `lossless` decodes every latent alone (a batch of one) with diffusers' own modules, so each
  item is bit-identical to `vae.decode` of that latent alone whatever it was batched with;
  batched convolutions are not batch-invariant on every backend (on our CPU a batched 1x1
  conv already differs in the last bits).
- `high` decodes the batch in one call with the fast path's gate on (see fastpath/). A model
  without a fast path answers `high` requests with `lossless`, and says so in the answer.
- `preview` maps the batch's latents to pixels with a linear map or a tiny decoder
  (engine/preview.py), never tiled, never with the VAE.

Each batch is planned first (engine/plan.py: runs, together or alone, tile grids), then executed
with the call's own state (a `DecodeCall`): the engine keeps no per-call state, so calls from
several threads do not interfere. The model's decode path (models/catalog.py) decides how:
`image_kl` through `vae.decode`; `causal_walk` one latent frame at a time by the engine's walk
(engine/wan_walk.py), both tiers; `generic` through the class's own `decode`, item by item.
Video (and any video-latent decoder) goes through engine/video.py: frames are converted, checked
and streamed or kept chunk by chunk. Memory: every request's peak is estimated
(engine/memory.py); over `limits.max_decode_bytes`, `high` decodes in spatial tiles
(engine/tiling.py) and `lossless` by the class's own tiled decode (models/diffusers_tiling.py),
refused in `prepare` when even that does not fit. A tiled request's tiles may decode on other
replicas (`spread`, engine/plan.py's TileSpreader), blended here to the same bits.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from vae_service.config import Limits, ServiceConfig
from vae_service.engine.calibration import calibrate_on_cuda
from vae_service.engine.cost import flops_per_output_pixel
from vae_service.engine.encoding import ENCODED_OUTPUTS, EncodeSettings, encode_all
from vae_service.engine.errors import DecodeFailed
from vae_service.engine.latents import LatentScaling, PreparedRequest, prepare
from vae_service.engine.memory import TierMemory
from vae_service.engine.memory_budget import memory_budget
from vae_service.engine.memory_plan import decode_bound, peak_bytes, plan_memory, plan_tiling
from vae_service.engine.plan import TILE_PARTS, BatchPlan, DecodeCall, Run, TileSpreader, checkpoint_hook, plan_batch
from vae_service.engine.postprocess import postprocess
from vae_service.engine.precision import PRECISION_NAMES, resolve_device, resolve_dtype
from vae_service.engine.preview import build_preview, frame_counts
from vae_service.engine.request import QUALITIES, DecodeRequest
from vae_service.engine.result import DecodeResult, PendingResult, Timing
from vae_service.engine.tiling import (
    DIFFUSERS_TILES,
    OnDevice,
    TileDecoder,
    TileRuns,
    spread_grid,
    tiled_chunks,
    tiled_image,
)
from vae_service.engine.video import NON_FINITE, decode_video
from vae_service.engine.wan_walk import walk_chunks, walk_options
from vae_service.fastpath import install_fast_path
from vae_service.fastpath.folded import FoldedBuffers
from vae_service.fastpath.rewrites import NORM_REWRITES, RewritePlan
from vae_service.models import LoadedVae, ModelLoadError, load_vae
from vae_service.models.diffusers_tiling import DECODER_PARTS, decoder_part, tiled_decode_elsewhere, tiled_view
from vae_service.models.spec import decoded_pixels, dropped_parts, jsonable_config, meta_twin, pipeline_statistics
from vae_service.models.wan_internals import diffusers_chunks, walk_unsupported_because

log = logging.getLogger(__name__)
_FOLDED_BYTES: dict[tuple, int] = {}  # the fast path's folded weights per model (see _price_tiers)


class DecodeEngine:
    def __init__(self, config: ServiceConfig, loaded: LoadedVae | None = None):
        self.device = resolve_device(config.device)
        self.cpu_threads = (config.cpu_threads or os.cpu_count() or 1) if self.device.type == "cpu" else None
        self.bind_thread()
        self.dtype = resolve_dtype(config.decode_precision, self.device)
        self.limits: Limits = config.limits  # the only live setting: budgets checked in `prepare`
        self.spread_from_pixels = config.parallel.min_output_pixels
        self.encode_settings = EncodeSettings(
            config.encoding.png_compress_level, config.encoding.jpeg_quality, config.encoding.mp4_fps
        )
        loaded = loaded or load_vae(config.model, name=config.served_name, seed=config.seed)
        self.spec = loaded.spec
        self.video = self.spec.family == "video"  # answers carry frames
        self.chunked = self.spec.geometry.video_latents  # decoded through engine/video.py
        # nn.Module.to, not ModelMixin.to: the latter warns about fp32-pinned modules these VAEs lack
        self.vae = torch.nn.Module.to(loaded.vae, device=self.device, dtype=self.dtype)
        self.fast_path = install_fast_path(self.vae, disabled=config.fast_path.disable)
        self.walks = self._walks()
        twin = meta_twin(loaded.vae)
        self.flops_per_pixel = flops_per_output_pixel(twin, self.spec, self._lossless_chunks)
        try:
            self._scaling = LatentScaling(self.spec, self.vae, self.dtype)
        except ValueError as exc:
            raise ModelLoadError(f"model: {self.spec.class_name}'s latent statistics: {exc}") from exc
        self.memory, folded = self._price_tiers(twin, config.fast_path.disable)
        weights = sum(t.numel() * t.element_size() for t in (*self.vae.parameters(), *self.vae.buffers()))
        self.budget = memory_budget(self.device, weights, folded)  # fixed for the engine's lifetime
        decode = lambda z: torch.cat(list(self._lossless_chunks(self.vae, z)), 2 if self.chunked else 0)  # noqa: E731
        self.preview = build_preview(config, self.spec, self._scaling, self.device, decode)
        # every decoder forward checks the running call (the walk, which calls the decoder's
        # modules one by one, checks before each latent frame in engine/video.py)
        getattr(self.vae, "decoder", self.vae).register_forward_pre_hook(checkpoint_hook)

    def _walks(self) -> dict | None:
        """Causal decoders the walk knows (engine/wan_walk.py): each tier's walk options. Others
        decode through their class's own forward."""
        if self.spec.path != "causal_walk":
            return None
        reasons = walk_unsupported_because(self.vae)
        if reasons:
            log.warning("%s decodes through diffusers' per-frame forward: %s", self.spec.class_name, reasons[:3])
            return None
        return walk_options(self.fast_path.plan if self.fast_path.installed else RewritePlan())

    def chunk_decoder(self, quality: str, timestep: float | None = None, folded: FoldedBuffers | None = None):
        """Video latents: a function from decoder-input latents to output chunks, as `quality` runs
        them (causal decoders: one chunk per latent frame; others: their whole output at once).
        `folded`: where `high` keeps its folded weights for the model passed as `vae` (the twin's)."""
        if self.walks is not None:
            options, folded = self.walks[quality], self.fast_path.folded if folded is None else folded
            return lambda z, vae=None: walk_chunks(vae or self.vae, z, options, folded)
        if self.spec.path == "causal_walk":
            return lambda z, vae=None: diffusers_chunks(vae or self.vae, z)
        return lambda z, vae=None: iter([self._pixels(vae or self.vae, z, timestep)])

    def _price_tiers(self, twin: torch.nn.Module, disabled: tuple[str, ...]) -> tuple[dict[str, TierMemory], int]:
        """Each tier's memory, counted on the meta twin running that tier's graph: the twin carries
        the fast path with this engine's rewrites (the exact ones run in both tiers; Triton kernels
        stand in on meta by allocating their outputs), `high` with its gate on. On CUDA both
        tiers are then checked against real decodes. Also the bytes of the folded weights `high`
        builds (held between decodes, like the weights)."""
        twin = torch.nn.Module.to(twin, dtype=self.dtype).eval()
        twin_fast = None
        if self.fast_path.installed:
            norms = [b for name, b in self.fast_path.plan.active.items() if name in NORM_REWRITES]
            twin_fast = install_fast_path(twin, disabled, norms[0] if norms else None, plan_device=self.device)
            if twin_fast.plan.active != self.fast_path.plan.active or not twin_fast.installed:
                raise ModelLoadError(f"fast path: its twin differs ({twin_fast.skipped_because or twin_fast.plan})")
        key = (
            self.spec.class_name,
            json.dumps(jsonable_config(self.vae), sort_keys=True),
            dropped_parts(self.vae),
            str(self.dtype),
            self.device.type,
            tuple(sorted(self.fast_path.plan.active.items())) if twin_fast else (),
        )
        lock, timestep = threading.Lock(), self._probe_timestep
        whole = lambda vae, z: iter([self._pixels(vae, z, timestep)])  # noqa: E731 (the class's own decode)
        lossless = TierMemory(twin, self.spec, self._lossless_chunks, lock, cache_key=(*key, "lossless"))
        tiers = {"lossless": lossless}
        twin_tiled = tiled_view(twin)
        if twin_tiled is not None:  # lossless above the bound: the model's own tiled decode
            tiers["lossless_tiled"] = TierMemory(twin_tiled, self.spec, whole, lock, per_shape=True, whole_clip=True)
        high = lossless
        if twin_fast is not None:
            if self.chunked:
                chunks = self.chunk_decoder("high", timestep, twin_fast.folded)
                high_decode = lambda vae, z: chunks(z, vae)  # noqa: E731
            else:
                high_decode = whole
            gate = lambda: twin_fast.gate.use(True)  # noqa: E731
            high = TierMemory(twin, self.spec, high_decode, lock, gate, cache_key=(*key, "high"))
            if twin_fast.folded.nbytes:  # probed here (a cached tier did not build them)
                _FOLDED_BYTES[key] = twin_fast.folded.nbytes
        if self.device.type == "cuda":
            calibrate_on_cuda(lossless, lambda z: self._lossless_chunks(self.vae, z), self.device)
            if high is not lossless:
                calibrate_on_cuda(high, self._high_chunks, self.device)
        return {**tiers, "high": high}, _FOLDED_BYTES.get(key, 0) if twin_fast else 0

    @property
    def _probe_timestep(self) -> float | None:
        """The timestep of decodes the engine runs for itself (counting, pricing, calibrating)."""
        return 0.0 if self.spec.timestep_conditioned else None

    def _high_chunks(self, z: torch.Tensor):
        with self.fast_path.gate.use(True):
            if self.chunked:
                yield from self.chunk_decoder("high", self._probe_timestep)(z)
            else:
                yield self._vae_decode(z)

    @staticmethod
    def _pixels(vae, z: torch.Tensor, timestep: float | None = None) -> torch.Tensor:
        """The class's own decode (`temb` for timestep-conditioned decoders, in the latents' dtype)."""
        temb = None if timestep is None else torch.full((z.shape[0],), timestep, dtype=z.dtype, device=z.device)
        return decoded_pixels(vae, z, temb)

    def _lossless_chunks(self, vae, z: torch.Tensor):
        """`lossless`'s decode of a whole batch as output chunks, on `vae` (the meta twin: memory and
        FLOP counts; the model itself: the preview's fit)."""
        timestep = self._probe_timestep
        if self.chunked:
            return self.chunk_decoder("lossless", timestep)(z, vae)
        return iter([self._pixels(vae, z, timestep)])

    def decode_bound(self) -> int:
        return decode_bound(self.limits, self.budget)

    @property
    def prices_in_constant_time(self) -> bool:
        """False when a tier's memory is priced per shape on the meta twin (up to seconds: the
        model's own tiled decode, for `lossless` above the bound, runs every tile there)."""
        return all(tier.affine for tier in self.memory.values())

    def peak_bytes(self, prepared: PreparedRequest) -> int:
        """Estimated peak of decoding this request whole (`lossless` above the bound: by the
        model's own tiled decode)."""
        tier = "lossless_tiled" if prepared.tile is DIFFUSERS_TILES else prepared.request.quality
        return peak_bytes(prepared, self.memory[tier])

    def bind_thread(self) -> None:
        """Make the calling thread decode like every other one of this engine. CPU kernels split
        reductions by torch's thread count, so results (and lossless bit-identity with a reference)
        depend on it; torch keeps the count per thread, fixed when a thread first runs a kernel."""
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        elif self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def precision(self) -> str:
        return PRECISION_NAMES[self.dtype]

    def describe(self) -> dict:
        return {
            "model": self.spec.name,
            "family": self.spec.family,
            "class": self.spec.class_name,
            "weights": "random (decodes noise)" if self.spec.random_weights else "loaded",
            "latent_channels": self.spec.latent_channels,
            **self.spec.describe(),
            "precision": self.precision,
            "device": str(self.device),
            "cpu_threads": self.cpu_threads,
            "tiers": sorted({self._tier(q) for q in QUALITIES}, key=QUALITIES.index),  # high -> lossless without it
            "preview": self.preview.kind,
            "config": jsonable_config(self.vae),
            "statistics": pipeline_statistics(self.vae),
            "fast_path": self.fast_path.describe(),
            "limits": self.limits.model_dump(),
            "decode_mflop_per_pixel": round(self.flops_per_pixel / 1e6, 3),
            "memory_plan": {
                "decode_bound_bytes": self.decode_bound(),
                "bound_from": "limits.max_decode_bytes" if self.limits.max_decode_bytes else "default",
                **self.budget.describe(),
                "tiers": {name: tier.describe() for name, tier in self.memory.items()},
            },
        }

    def prepare(self, request: DecodeRequest) -> PreparedRequest:
        """Check against this model and the limits, plan tiling; no tensor is moved or cast yet.
        Raises InvalidInput."""
        limits = self.limits  # read once: another thread may swap them (reconfigure)
        if request.quality != self._tier(request.quality):
            request = replace(request, quality=self._tier(request.quality))
        if request.quality == "preview":  # no decoder work, no tiles
            return prepare(request, self.spec, limits, 0.0)
        prepared = prepare(request, self.spec, limits, self.flops_per_pixel)
        tier = prepared.request.quality
        bound = decode_bound(limits, self.budget)
        grid = plan_tiling(prepared, self.memory[tier], bound, self.memory.get("lossless_tiled"))
        if grid is None and tier == "high" and request.tiling == "auto":  # within the bound: spread if large
            grid = spread_grid(*prepared.latents.shape[-2:], self.spec.spatial_scale, self.spread_from_pixels)
        return prepared if grid is None else replace(prepared, tile=grid)

    def _tier(self, quality: str) -> str:
        """The tier that decodes a request for `quality`: `high` needs an installed fast path."""
        return quality if quality != "high" or self.fast_path.installed else "lossless"

    def plan(self, batch: list[PreparedRequest], bound: int, force_tiles: bool = False) -> BatchPlan:
        """The batch's plan (engine/plan.py); `force_tiles`: the out-of-memory retry's, every
        request in tiles of half its estimated peak."""
        if force_tiles:
            grids = [plan_memory(r, self.memory["high"], self.peak_bytes(r) // 2, force=True) for r in batch]
        else:
            grids = [r.tile for r in batch]
        return plan_batch(batch, grids, self.peak_bytes, bound)

    def decode(
        self,
        batch: list[PreparedRequest],
        abandoned: threading.Event | None = None,
        defer_host_copy: bool = False,
        spread: TileSpreader | None = None,
    ) -> list[DecodeResult | DecodeFailed | PendingResult]:
        """Decode requests that share one batch key; results come back in order. A request whose
        output is not finite gets a DecodeFailed in its place; the others are unaffected. Once
        `abandoned` is set, the decode stops before its next decoder call (DecodeAbandoned).
        `defer_host_copy` (CUDA): outputs whose copy to the host is still running come back as
        PendingResults. `spread`: tiled requests decode their tiles through it (other replicas,
        engine.decode_tile or tile_chunks there), blended here as if decoded here; video tiles in
        lockstep, chunk by chunk. Safe to call from several threads at once."""
        call = DecodeCall(abandoned, [] if defer_host_copy else None, spread)
        quality = batch[0].request.quality
        start = time.perf_counter()
        scaling = self.preview.scaling if quality == "preview" else self._scaling
        latents = [scaling.to_decoder_input(r, self.device) for r in batch]
        bound = self.decode_bound()
        plan = self.plan(batch, bound)
        with torch.inference_mode(), self.fast_path.gate.use(quality == "high"), call.running():
            outputs = self._execute_or_out_of_memory(plan, batch, latents, call)
            if outputs is None:  # out of memory: once more in tiles of half the estimated peak
                self._release_device_cache()
                plan = self.plan(batch, bound, force_tiles=True)
                outputs = self._execute(plan, batch, latents, call)
        timing = Timing(0.0, (time.perf_counter() - start) * 1e3, sum(r.items for r in batch), replicas=call.replicas)
        results = [
            o if isinstance(o, DecodeFailed) else self._result(o, r, timing, plan.tiled)
            for o, r in zip(outputs, batch, strict=True)
        ]
        if not call.host_copies:
            return results
        copies = tuple(call.host_copies)
        return [r if isinstance(r, DecodeFailed) else PendingResult(r, copies) for r in results]

    def _execute_or_out_of_memory(self, plan: BatchPlan, batch: list[PreparedRequest], latents: list, call):
        """The plan's outputs, or None when an untiled `high` decode ran out of device memory. The
        retry happens in the caller, after this frame and the exception's traceback are gone:
        inside the handler they would keep the failed attempt's activations alive, and freeing the
        cache would give nothing back."""
        try:
            return self._execute(plan, batch, latents, call)
        except torch.OutOfMemoryError:
            if plan.quality != "high" or plan.tiled:
                raise
        return None

    def _release_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _execute(
        self, plan: BatchPlan, batch: list[PreparedRequest], latents: list[torch.Tensor], call: DecodeCall
    ) -> list[torch.Tensor | DecodeFailed | None]:
        """Every run of the plan, in order: one output per request (None once streamed)."""
        outputs: list = [None] * len(batch)
        for run in plan.runs:
            requests = [batch[i] for i in run.members]
            zs = [latents[i] for i in run.members]
            if self.chunked:
                decoded = self._run_video(plan.quality, run, requests, zs, call)
            else:
                pixels = self._run_image(plan.quality, run, requests, zs, call)
                decoded = [self._finish(d, r, call) for d, r in zip(pixels, requests, strict=True)]
            for i, output in zip(run.members, decoded, strict=True):
                outputs[i] = output
        return outputs

    def _run_image(
        self, quality: str, run: Run, requests: list[PreparedRequest], latents: list[torch.Tensor], call: DecodeCall
    ) -> list[torch.Tensor]:
        """One run's decoded pixels, one tensor per request."""
        sizes = [z.shape[0] for z in latents]
        if quality == "preview":
            return list(self.preview.image(torch.cat(latents)).split(sizes))
        if run.grid is DIFFUSERS_TILES:  # lossless above the bound: the model's own tiled decode, item by item
            return [self._tiled_alone(z, r.timestep, call) for z, r in zip(latents, requests, strict=True)]
        if not run.together:  # lossless: every item alone
            return [self._each_alone(self.vae, z, r.timestep) for z, r in zip(latents, requests, strict=True)]
        if run.grid is not None:
            (z,) = latents
            return [tiled_image(z, run.grid, self.spec.spatial_scale, self._tile_decoder(quality, call))]
        return list(self._vae_decode(torch.cat(latents)).split(sizes))

    def _tile_decoder(self, quality: str, call: DecodeCall) -> TileDecoder:
        """Tiles decoded here one by one, or all at once by the call's spreader (other replicas:
        their pixels come back as sent, and are blended here on this device)."""
        if call.spread is None:
            return lambda tiles: map(self._vae_decode, tiles)
        return lambda tiles: self._here(call.spread.images(tiles, quality, call.decoded_by))

    def _here(self, outputs):
        return (out.to(self.device) for out in outputs)  # one at a time on the device, as blended

    def decode_tile(self, z: torch.Tensor, part: str = "high") -> torch.Tensor:
        """One tile of another replica's request (`spread`), from its decoder-input latents: as
        that replica's tiled `high` plan decodes a tile, or a job of the model's own tiled decode
        (`decoder`: the decoder module alone; `causal_decoder`: a Wan or Qwen-Image tile, all its
        latent frames on a fresh cache); never split again."""
        if part not in TILE_PARTS:
            raise ValueError(f"part: {part!r} is not one of {TILE_PARTS}")
        with torch.inference_mode(), self.fast_path.gate.use(part == "high"):
            z = z.to(self.device, self.dtype)
            return decoder_part(self.vae, z, part) if part in DECODER_PARTS else self._vae_decode(z)

    def tile_chunks(self, z: torch.Tensor, quality: str, timestep: float | None) -> Iterator[torch.Tensor]:
        """One video tile of another replica's request (`spread`): its output chunks, as that
        replica's tiled plan decodes the tile (its own causal history); never split again. Run it
        to the end on one thread: the tier's settings hold for the whole tile."""
        if quality not in ("high", "lossless"):
            raise ValueError(f"quality: {quality!r} is not a decoder tier")
        with torch.inference_mode(), self.fast_path.gate.use(quality == "high"):
            yield from self.chunk_decoder(quality, timestep)(z.to(self.device, self.dtype))

    def _tile_runs(self, quality: str, timestep: float | None, call: DecodeCall) -> TileRuns:
        """Video tiles: every tile's chunks, decoded here (lazily, as read) or by the call's spreader."""
        if call.spread is not None:
            spread, device, seen = call.spread, self.device, call.decoded_by
            return lambda tiles: [OnDevice(run, device) for run in spread.chunks(tiles, quality, timestep, seen)]
        chunks = self.chunk_decoder(quality, timestep)

        def lazy(tile: torch.Tensor) -> Iterator[torch.Tensor]:
            yield from chunks(tile)  # started when first read: tile after tile holds one tile at a time

        return lambda tiles: [lazy(tile) for tile in tiles]

    def _run_video(
        self, quality: str, run: Run, requests: list[PreparedRequest], latents: list[torch.Tensor], call: DecodeCall
    ) -> list:
        if quality == "preview":
            law = self.spec.geometry.frames.law if self.spec.geometry.frames else None
            counts = frame_counts(requests[0].frames, requests[0].latent_frames, law)
            chunks = lambda z: self.preview.chunks(z, counts)  # noqa: E731
        elif run.grid is DIFFUSERS_TILES:  # lossless above the bound: the whole clip at once, at the end
            timestep = requests[0].timestep
            chunks = lambda z: iter([self._tiled_alone(z, timestep, call)])  # noqa: E731
        elif run.grid is not None:
            runs, grid, scale = self._tile_runs(quality, requests[0].timestep, call), run.grid, self.spec.spatial_scale
            chunks = lambda z: tiled_chunks(z, grid, scale, runs)  # noqa: E731
        else:
            chunks = self.chunk_decoder(quality, requests[0].timestep)
        outputs = decode_video(requests, latents, run.together, chunks, call, self.spec.entry.pixels)
        return outputs if self.video else [_one_frame(o) for o in outputs]

    def _result(
        self, output: torch.Tensor | None, prepared: PreparedRequest, timing: Timing, tiled: bool
    ) -> DecodeResult:
        request = prepared.request
        encode_as = request.output if request.output in ENCODED_OUTPUTS else None
        return DecodeResult(
            output, self.spec.name, self.precision, request.quality, request.request_id, timing, encode_as, tiled
        )

    def encode(self, result: DecodeResult) -> DecodeResult:
        """Encode a result's pixels here, item after item (in-process callers; the service encodes
        in a pool, off the device thread)."""
        if result.encode_as is None:
            return result
        start = time.perf_counter()
        files = encode_all(result.output.numpy(), result.encode_as, self.encode_settings)
        timing = replace(result.timing, encode_ms=(time.perf_counter() - start) * 1e3)
        return replace(result, output=files, encode_as=None, timing=timing)

    def _finish(self, decoded: torch.Tensor, prepared: PreparedRequest, call: DecodeCall):
        if not bool(torch.isfinite(decoded).all()):
            return DecodeFailed("latents", NON_FINITE)
        return postprocess(decoded, prepared.request.output, call.host_copies, self.spec.entry.pixels)

    def _vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample

    def _tiled_alone(self, z: torch.Tensor, timestep: float | None, call: DecodeCall) -> torch.Tensor:
        """The model's own tiled decode of each item; with a spreader, its decoder's tiles are
        decoded by other replicas (models/diffusers_tiling.py: still the same bits)."""
        view = tiled_view(self.vae)
        if call.spread is None or timestep is not None:
            return self._each_alone(view, z, timestep)
        spread = call.spread

        def decode_tiles(tiles: list[torch.Tensor], part: str):
            return self._here(spread.images(tiles, part, call.decoded_by))

        decoded = []
        for item in z.split(1):
            pixels = tiled_decode_elsewhere(view, item, decode_tiles, call.checkpoint)
            decoded.append(self._pixels(view, item) if pixels is None else pixels)
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded)

    def _each_alone(self, vae, z: torch.Tensor, timestep: float | None) -> torch.Tensor:
        decoded = [self._pixels(vae, item, timestep) for item in z.split(1)]
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded)

    def release_folded(self) -> int:
        """Drop the fast path's folded weights (rebuilt by the next `high` decode); bytes freed."""
        return self.fast_path.release()

    def check_device(self) -> None:
        """Raise when the device or the weights are no longer usable (health checks)."""
        probe = torch.ones(8, device=self.device, dtype=self.dtype)
        if float((probe * 2).sum().item()) != 16.0:
            raise RuntimeError(f"device {self.device} computes wrong results")
        if next(self.vae.parameters()).device.type != self.device.type:
            raise RuntimeError("model weights left the device")


def _one_frame(output):
    """An image model with a video decoder (Qwen-Image): its one frame as an image, uint8
    [B, 1, H, W, 3] -> [B, H, W, 3], float [B, 3, 1, H, W] -> [B, 3, H, W]."""
    if not isinstance(output, torch.Tensor):
        return output
    return output.squeeze(1) if output.dtype == torch.uint8 else output.squeeze(2)
