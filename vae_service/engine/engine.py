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

The model's decode path (models/catalog.py) decides how: `image_kl` through `vae.decode`;
`causal_walk` one latent frame at a time by the chunk walk; `generic` through the class's own
`decode`, item by item. Video (and any video-latent decoder) goes through engine/video.py: frames
are converted, checked and streamed or kept chunk by chunk. Memory: every request's peak is
estimated (engine/memory.py); over `limits.max_decode_bytes`, `high` decodes in spatial tiles
(engine/tiling.py) and `lossless`, which never tiles, is refused in `prepare`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace

import torch

from vae_service.config import Limits, ServiceConfig
from vae_service.engine.calibration import calibrate_on_cuda
from vae_service.engine.cost import flops_per_output_pixel
from vae_service.engine.encoding import ENCODED_OUTPUTS, EncodeSettings, encode_all
from vae_service.engine.errors import DecodeAbandoned, DecodeFailed
from vae_service.engine.latents import LatentScaling, PreparedRequest, prepare
from vae_service.engine.memory import TierMemory
from vae_service.engine.memory_budget import memory_budget
from vae_service.engine.memory_plan import decode_bound, peak_bytes, plan_memory
from vae_service.engine.postprocess import postprocess
from vae_service.engine.precision import PRECISION_NAMES, resolve_device, resolve_dtype
from vae_service.engine.preview import build_preview, frame_counts
from vae_service.engine.request import QUALITIES, DecodeRequest
from vae_service.engine.result import DecodeResult, Timing
from vae_service.engine.tiling import TileGrid, tiled_chunks, tiled_image
from vae_service.engine.video import NON_FINITE, decode_video
from vae_service.fastpath import install_fast_path
from vae_service.fastpath.install import FastPath
from vae_service.fastpath.rewrites import NORM_REWRITES
from vae_service.fastpath.wan_chunks import decode_chunks
from vae_service.models import LoadedVae, ModelLoadError, load_vae
from vae_service.models.spec import decoded_pixels, dropped_parts, jsonable_config, meta_twin, pipeline_statistics

_FOLDED_BYTES: dict[tuple, int] = {}  # the fast path's folded weights per model (see _price_tiers)


class DecodeEngine:
    def __init__(self, config: ServiceConfig, loaded: LoadedVae | None = None):
        self.device = resolve_device(config.device)
        self.cpu_threads = (config.cpu_threads or os.cpu_count() or 1) if self.device.type == "cpu" else None
        self.bind_thread()
        self.dtype = resolve_dtype(config.decode_precision, self.device)
        self.limits: Limits = config.limits  # the only live setting: budgets checked in `prepare`
        self.encode_settings = EncodeSettings(
            config.encoding.png_compress_level, config.encoding.jpeg_quality, config.encoding.mp4_fps
        )
        loaded = loaded or load_vae(config.model, name=config.served_name, seed=config.seed)
        self.spec = loaded.spec
        self.video = self.spec.family == "video"  # answers carry frames
        self.walk = self.spec.path == "causal_walk"
        self.chunked = self.spec.geometry.video_latents  # decoded through engine/video.py
        # nn.Module.to, not ModelMixin.to: the latter warns about fp32-pinned modules these VAEs lack
        self.vae = torch.nn.Module.to(loaded.vae, device=self.device, dtype=self.dtype)
        self.fast_path = install_fast_path(self.vae, disabled=config.fast_path.disable)
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
        # the decoder runs once per item (lossless) and once per latent frame (Wan): the step at
        # which a decode whose requests were all abandoned stops
        self._abandoned: threading.Event | None = None
        self._host_copies: list | None = None  # CUDA events of the host copies still running
        getattr(self.vae, "decoder", self.vae).register_forward_pre_hook(self._stop_if_abandoned)

    def chunk_decoder(self, quality: str, timestep: float | None = None, fast_path: FastPath | None = None):
        """Video latents: a function from decoder-input latents to output chunks, as `quality` runs
        them (the walk: one chunk per latent frame; other decoders: their whole output at once).
        `fast_path`: the one installed on the model passed as `vae` (the meta twin's)."""
        if self.walk:
            fast_path = fast_path or self.fast_path
            walk, folded = fast_path.chunk_walks[quality], fast_path.folded
            return lambda z, vae=None: decode_chunks(vae or self.vae, z, walk, folded)
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
        lock = threading.Lock()
        lossless = TierMemory(twin, self.spec, self._lossless_chunks, lock, cache_key=(*key, "lossless"))
        high = lossless
        if twin_fast is not None:
            timestep = self._probe_timestep
            if self.chunked:
                chunks = self.chunk_decoder("high", timestep, twin_fast)
                high_decode = lambda vae, z: chunks(z, vae)  # noqa: E731
            else:
                high_decode = lambda vae, z: iter([self._pixels(vae, z, timestep)])  # noqa: E731
            gate = lambda: twin_fast.gate.use(True)  # noqa: E731
            high = TierMemory(twin, self.spec, high_decode, lock, gate, cache_key=(*key, "high"))
            if twin_fast.folded.nbytes:  # probed here (a cached tier did not build them)
                _FOLDED_BYTES[key] = twin_fast.folded.nbytes
        if self.device.type == "cuda":
            calibrate_on_cuda(lossless, lambda z: self._lossless_chunks(self.vae, z), self.device)
            if high is not lossless:
                calibrate_on_cuda(high, self._high_chunks, self.device)
        return {"lossless": lossless, "high": high}, _FOLDED_BYTES.get(key, 0) if twin_fast else 0

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
        """False when a tier's memory is priced per shape on the meta twin (up to a second)."""
        return all(tier.affine for tier in self.memory.values())

    def peak_bytes(self, prepared: PreparedRequest) -> int:
        """Estimated peak of decoding this request whole."""
        return peak_bytes(prepared, self.memory[prepared.request.quality])

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
                "tiers": {q: self.memory[q].describe() for q in ("lossless", "high")},
            },
        }

    def prepare(self, request: DecodeRequest) -> PreparedRequest:
        """Check against this model and the limits, plan tiling; no tensor is moved or cast yet.
        Raises InvalidInput."""
        if request.quality != self._tier(request.quality):
            request = replace(request, quality=self._tier(request.quality))
        if request.quality == "preview":  # no decoder work, no tiles
            return prepare(request, self.spec, self.limits, 0.0)
        prepared = prepare(request, self.spec, self.limits, self.flops_per_pixel)
        grid = plan_memory(prepared, self.memory[prepared.request.quality], self.decode_bound())
        return prepared if grid is None else replace(prepared, tile=grid)

    def _tier(self, quality: str) -> str:
        """The tier that decodes a request for `quality`: `high` needs an installed fast path."""
        return quality if quality != "high" or self.fast_path.installed else "lossless"

    def _stop_if_abandoned(self, module, args) -> None:
        if self._abandoned is not None and self._abandoned.is_set():
            raise DecodeAbandoned("body", "every request of this decode timed out or went away")

    def decode(
        self, batch: list[PreparedRequest], abandoned: threading.Event | None = None, defer_host_copy: bool = False
    ) -> list[DecodeResult | DecodeFailed]:
        """Decode requests that share one batch key; results come back in order. A request whose
        output is not finite gets a DecodeFailed in its place; the others are unaffected. Once
        `abandoned` is set, the decode stops at its next item or latent frame (DecodeAbandoned).
        `defer_host_copy` (CUDA): outputs come back while their copy to the host is still
        running; wait on `result.host_copies` before reading them (DecodeResult.wait_for_host)."""
        self._abandoned, self._host_copies = abandoned, ([] if defer_host_copy else None)
        try:
            results = self._decode(batch)
            copies = tuple(self._host_copies or ())
            return [r if isinstance(r, DecodeFailed) else replace(r, host_copies=copies) for r in results]
        finally:
            self._abandoned = self._host_copies = None

    def _decode(self, batch: list[PreparedRequest]) -> list[DecodeResult | DecodeFailed]:
        keys = {r.batch_key for r in batch}
        if len(keys) != 1:
            raise ValueError(f"a batch must share one (tier, shape, dtype) key, got {sorted(map(str, keys))}")
        quality = batch[0].request.quality
        start = time.perf_counter()
        scaling = self.preview.scaling if quality == "preview" else self._scaling
        latents = [scaling.to_decoder_input(r, self.device) for r in batch]
        with torch.inference_mode(), self.fast_path.gate.use(quality == "high"):
            decoded = self._decode_or_out_of_memory(batch, latents)
            if decoded is None:  # out of memory: once more in tiles of half the estimated peak
                self._release_device_cache()
                decoded = self._decode_batch(batch, latents, force_tiles=True)
        outputs, tiled = decoded
        timing = Timing(0.0, (time.perf_counter() - start) * 1e3, sum(r.items for r in batch))
        return [
            o if isinstance(o, DecodeFailed) else self._result(o, r, timing, tiled)
            for o, r in zip(outputs, batch, strict=True)
        ]

    def _decode_or_out_of_memory(self, batch: list[PreparedRequest], latents: list[torch.Tensor]):
        """The decode, or None when an untiled `high` decode ran out of device memory. The retry
        happens in the caller, after this frame and the exception's traceback are gone: inside the
        handler they would keep the failed attempt's activations alive, and freeing the cache
        would give nothing back."""
        try:
            return self._decode_batch(batch, latents, force_tiles=False)
        except torch.OutOfMemoryError:
            if batch[0].request.quality != "high" or batch[0].tile is not None:
                raise
        return None

    def _release_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _grids(self, batch: list[PreparedRequest], force_tiles: bool) -> list[TileGrid | None]:
        if force_tiles:
            return [plan_memory(r, self.memory["high"], self.peak_bytes(r) // 2, force=True) for r in batch]
        return [r.tile for r in batch]

    def _together(self, batch: list[PreparedRequest], grids: list) -> bool:
        """High decodes the batch in one call when untiled and within the bound together."""
        if batch[0].request.quality != "high" or grids[0] is not None:
            return False
        return len(batch) == 1 or sum(self.peak_bytes(r) for r in batch) <= self.decode_bound()

    def _decode_batch(self, batch: list[PreparedRequest], latents: list[torch.Tensor], force_tiles: bool):
        grids = self._grids(batch, force_tiles)
        tiled = grids[0] is not None
        if self.chunked:
            return self._decode_video(batch, latents, grids), tiled
        quality = batch[0].request.quality
        if quality == "preview":
            decoded = list(self.preview.image(torch.cat(latents)).split([z.shape[0] for z in latents]))
        elif quality == "lossless":
            decoded = [self._decode_each_alone(z, batch[0].timestep) for z in latents]
        elif self._together(batch, grids):
            decoded = self._decode_together(latents)
        elif tiled:
            scale = self.spec.spatial_scale
            decoded = [tiled_image(z, g, scale, self._vae_decode) for z, g in zip(latents, grids, strict=True)]
        else:
            decoded = [self._vae_decode(z) for z in latents]
        return [self._finish(d, r) for d, r in zip(decoded, batch, strict=True)], tiled

    def _decode_video(self, batch: list[PreparedRequest], latents: list[torch.Tensor], grids: list) -> list:
        quality = batch[0].request.quality
        scale = self.spec.spatial_scale
        if quality == "preview":
            law = self.spec.geometry.frames.law if self.spec.geometry.frames else None
            counts = frame_counts(batch[0].frames, batch[0].latent_frames, law)
            plain = lambda z: self.preview.chunks(z, counts)  # noqa: E731
        else:
            plain = self.chunk_decoder(quality, batch[0].timestep)

        def chunks_for(grid: TileGrid | None):
            return plain if grid is None else lambda z: tiled_chunks(z, grid, scale, plain)

        def checkpoint() -> None:
            self._stop_if_abandoned(None, None)

        pixels, pending = self.spec.entry.pixels, self._host_copies
        if quality == "lossless" or quality == "preview" or self._together(batch, grids):
            together = quality != "lossless"
            outputs = decode_video(batch, latents, together, chunks_for(grids[0]), checkpoint, pending, pixels)
        else:
            outputs = [
                decode_video([r], [z], True, chunks_for(g), checkpoint, pending, pixels)[0]
                for r, z, g in zip(batch, latents, grids, strict=True)
            ]
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

    def _finish(self, decoded: torch.Tensor, prepared: PreparedRequest):
        if not bool(torch.isfinite(decoded).all()):
            return DecodeFailed("latents", NON_FINITE)
        return postprocess(decoded, prepared.request.output, self._host_copies, self.spec.entry.pixels)

    def _vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample

    def _decode_each_alone(self, z: torch.Tensor, timestep: float | None) -> torch.Tensor:
        if z.shape[0] == 1:
            return self._pixels(self.vae, z, timestep)
        return torch.cat([self._pixels(self.vae, item, timestep) for item in z.split(1)])

    def _decode_together(self, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self._vae_decode(torch.cat(latents))
        return list(out.split([z.shape[0] for z in latents]))

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
