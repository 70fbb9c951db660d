"""The model on its device: one VAE at one precision with its fast path installed, fixed for its
lifetime, and the decode primitives every plan is made of. Nothing here decides what to decode or
at what price (engine/pricing/cost_model.py, engine/planning/planner.py); the executor
(engine/execution/executor.py) calls these primitives for a plan.

Decode paths (models/catalog.py): `image_kl` through `vae.decode`; `causal_walk` one latent frame
at a time by the engine's walk (engine/runtime/wan_walk.py) in both tiers, or diffusers' own per-frame
forward where the walk does not know the decoder; `generic` through the class's own `decode`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from vae_service.config import ServiceConfig
from vae_service.engine.request.errors import InvalidInput
from vae_service.engine.request.latents import LatentScaling
from vae_service.engine.runtime.fingerprint import Fingerprint
from vae_service.engine.runtime.precision import PRECISION_NAMES, resolve_device, resolve_dtype
from vae_service.engine.runtime.tile_jobs import DecoderInput, TierTile, TileJob
from vae_service.engine.runtime.wan_walk import WalkOptions, walk_chunks, walk_options
from vae_service.fastpath import install_fast_path
from vae_service.fastpath.folded import FoldedBuffers
from vae_service.fastpath.rewrites import RewritePlan
from vae_service.models import LoadedVae, ModelLoadError, load_vae
from vae_service.models.diffusers_tiling import decode_causal_tile, replay_unsupported_because
from vae_service.models.spec import decoded_pixels, jsonable_config
from vae_service.models.wan_internals import diffusers_chunks, walk_unsupported_because

log = logging.getLogger(__name__)

DECODER_TIERS = ("lossless", "high")


class ChunkDecoder:
    """Video latents -> the output chunks one tier decodes them to, on `vae` (the model, or its meta
    twin for pricing): causal decoders one chunk per latent frame, others their whole output at once."""

    def __init__(
        self,
        runtime: Runtime,
        quality: str,
        timestep: float | None,
        vae: torch.nn.Module | None = None,
        folded: FoldedBuffers | None = None,
    ):
        self.runtime, self.timestep = runtime, timestep
        self.vae = runtime.vae if vae is None else vae
        self.walk: WalkOptions | None = None if runtime.walks is None else runtime.walks[quality]
        self.folded = runtime.fast_path.folded if folded is None else folded

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        if self.walk is not None:
            return walk_chunks(self.vae, z, self.walk, self.folded)
        if self.runtime.spec.path == "causal_walk":
            return diffusers_chunks(self.vae, z)
        return iter([self.runtime.pixels(self.vae, z, self.timestep)])


class Runtime:
    def __init__(self, config: ServiceConfig, loaded: LoadedVae | None = None):
        self.device = resolve_device(config.device)
        self.cpu_threads = (config.cpu_threads or os.cpu_count() or 1) if self.device.type == "cpu" else None
        self.bind_thread()
        self.dtype = resolve_dtype(config.decode_precision, self.device)
        loaded = loaded or load_vae(config.model, name=config.served_name, seed=config.seed)
        self.spec = loaded.spec
        self.video = self.spec.family == "video"  # answers carry frames
        self.chunked = self.spec.geometry.video_latents  # decoded through engine/execution/video.py
        # nn.Module.to, not ModelMixin.to: the latter warns about fp32-pinned modules these VAEs lack
        self.vae = torch.nn.Module.to(loaded.vae, device=self.device, dtype=self.dtype)
        self.fast_path = install_fast_path(self.vae, disabled=config.fast_path.disable)
        self.walks = self._walks()
        # why the class's own tiled decode (lossless above the bound) cannot share its tiles (none: it can)
        self.replay_unsupported = replay_unsupported_because(self.vae)
        try:
            self.scaling = LatentScaling(self.spec, self.vae, self.dtype)
        except ValueError as exc:
            raise ModelLoadError(f"model: {self.spec.class_name}'s latent statistics: {exc}") from exc
        rewrites = self.fast_path.plan.active if self.fast_path.installed else {}
        self.fingerprint = Fingerprint.of(
            self.vae, jsonable_config(self.vae), self.precision, self.device, rewrites, self.cpu_threads
        )

    def _walks(self) -> dict[str, WalkOptions] | None:
        """Causal decoders the walk knows (engine/runtime/wan_walk.py): each tier's walk options. Others
        decode through their class's own forward."""
        if self.spec.path != "causal_walk":
            return None
        reasons = walk_unsupported_because(self.vae)
        if reasons:
            log.warning("%s decodes through diffusers' per-frame forward: %s", self.spec.class_name, reasons[:3])
            return None
        return walk_options(self.fast_path.plan if self.fast_path.installed else RewritePlan())

    # ---- what the model decodes --------------------------------------------------------------
    @property
    def precision(self) -> str:
        return PRECISION_NAMES[self.dtype]

    @property
    def probe_timestep(self) -> float | None:
        """The timestep of decodes the engine runs for itself (counting, pricing, calibrating)."""
        return 0.0 if self.spec.timestep_conditioned else None

    def tier(self, quality: str) -> str:
        """The tier that decodes a request for `quality`: `high` needs an installed fast path."""
        return quality if quality != "high" or self.fast_path.installed else "lossless"

    def gate(self, quality: str) -> AbstractContextManager:
        """The fast path on for `high`, off otherwise, on this thread, restored after."""
        return self.fast_path.gate.use(quality == "high")

    # ---- primitives --------------------------------------------------------------------------
    def image(self, z: torch.Tensor) -> torch.Tensor:
        """`vae.decode(z).sample` of image latents (the gate decides which operators run)."""
        return self.vae.decode(z).sample

    @staticmethod
    def pixels(vae: torch.nn.Module, z: torch.Tensor, timestep: float | None = None) -> torch.Tensor:
        """The class's own decode (`temb` for timestep-conditioned decoders, in the latents' dtype)."""
        temb = None if timestep is None else torch.full((z.shape[0],), timestep, dtype=z.dtype, device=z.device)
        return decoded_pixels(vae, z, temb)

    def each_alone(self, vae: torch.nn.Module, z: torch.Tensor, timestep: float | None) -> torch.Tensor:
        """The class's own decode of every item alone (a batch of one): `lossless`."""
        decoded = [self.pixels(vae, item, timestep) for item in z.split(1)]
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded)

    def chunks(self, quality: str, timestep: float | None) -> ChunkDecoder:
        return ChunkDecoder(self, quality, timestep)

    def whole_batch(self, z: torch.Tensor) -> torch.Tensor:
        """`lossless`' decode of a batch at once, as one tensor (the preview's fit)."""
        if self.chunked:
            return torch.cat(list(ChunkDecoder(self, "lossless", self.probe_timestep)(z)), 2)
        return self.pixels(self.vae, z, self.probe_timestep)

    def to_device(self, z: torch.Tensor) -> torch.Tensor:
        return z.to(self.device, self.dtype)

    def run_job(self, job: TileJob) -> Iterator[torch.Tensor]:
        """A tile job's output on this device (engine/runtime/tile_jobs.py), chunk by chunk, computed as
        each is read; the same bits wherever it runs with the same fingerprint. The caller holds
        the job's gate (`job_tier`) and inference mode for the whole run."""
        z = self.to_device(job.latents)
        if isinstance(job, TierTile):
            if self.chunked:
                yield from self.chunks(job.quality, job.timestep)(z)
            else:
                yield self.image(z)
        elif isinstance(job, DecoderInput):
            yield self.vae.decoder(z)
        else:
            yield decode_causal_tile(self.vae, z)

    def job_tier(self, job: TileJob) -> str:
        """The tier whose operators decode `job`: its own, or `lossless` for the class's tiled decode."""
        if isinstance(job, TierTile):
            self.check_quality(job.quality)
            return self.tier(job.quality)
        return "lossless"

    # ---- lifecycle ---------------------------------------------------------------------------
    def bind_thread(self) -> None:
        """Make the calling thread decode like every other one of this engine. CPU kernels split
        reductions by torch's thread count, so results (and lossless bit-identity with a reference)
        depend on it; torch keeps the count per thread, fixed when a thread first runs a kernel."""
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)
        elif self.device.type == "cuda":  # "cuda" alone means the current device (set_device wants an index)
            torch.cuda.set_device(self.device.index if self.device.index is not None else torch.cuda.current_device())

    def check_quality(self, quality: str) -> None:
        if quality not in DECODER_TIERS:
            raise InvalidInput("quality", f"{quality!r} is not a decoder tier ({list(DECODER_TIERS)})")

    def release_folded(self) -> int:
        """Drop the fast path's folded weights (rebuilt by the next `high` decode); bytes freed."""
        return self.fast_path.release()

    def release_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_device(self) -> None:
        """Raise when the device or the weights are no longer usable (health checks)."""
        probe = torch.ones(8, device=self.device, dtype=self.dtype)
        if float((probe * 2).sum().item()) != 16.0:
            raise RuntimeError(f"device {self.device} computes wrong results")
        if next(self.vae.parameters()).device.type != self.device.type:
            raise RuntimeError("model weights left the device")
