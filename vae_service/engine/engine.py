"""DecodeEngine: one VAE on one device at one precision; decodes homogeneous batches.

Tier decisions live here and only here:
- `lossless` decodes every latent alone (a batch of one) with diffusers' own modules, so each
  item is bit-identical to `vae.decode` of that latent alone whatever it was batched with;
  batched convolutions are not batch-invariant on every backend (on our CPU a batched 1x1
  conv already differs in the last bits).
- `high` decodes the batch in one call with the fast path's gate on (see fastpath/).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from vae_service.config import ServiceConfig
from vae_service.engine.latents import PreparedRequest, prepare
from vae_service.engine.postprocess import postprocess
from vae_service.engine.precision import PRECISION_NAMES, resolve_device, resolve_dtype
from vae_service.errors import DecodeFailed, RequestError
from vae_service.fastpath import install_fast_path
from vae_service.models import LoadedVae, load_vae
from vae_service.protocol.decode_schema import DecodeParams


@dataclass
class DecodeResult:
    output: torch.Tensor | list[bytes]
    decode_ms: float
    batch_size: int  # latent items decoded in the same engine call


class DecodeEngine:
    def __init__(self, config: ServiceConfig, loaded: LoadedVae | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            # CPU kernels split reductions by thread count, so results (and lossless bit-identity
            # with a reference) depend on it: fix it per deployment.
            torch.set_num_threads(config.cpu_threads or os.cpu_count() or 1)
        self.dtype = resolve_dtype(config.decode_precision, self.device)
        loaded = loaded or load_vae(config.model, name=config.served_name, seed=config.seed)
        self.spec = loaded.spec
        # nn.Module.to, not ModelMixin.to: the latter warns about fp32-pinned modules these VAEs lack
        self.vae = torch.nn.Module.to(loaded.vae, device=self.device, dtype=self.dtype)
        self.fast_path = install_fast_path(self.vae)

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
            "precision": self.precision,
            "device": str(self.device),
            "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "tiers": ["lossless", "high"],
            "fast_path": self.fast_path.describe(),
            "limits": self.config.limits.model_dump(),
        }

    def prepare(self, params: DecodeParams) -> PreparedRequest:
        """Validate against this model and move to the device. Raises RequestError (4xx)."""
        if params.model is not None and params.model != self.spec.name:
            raise RequestError("model", f"unknown model {params.model!r}; served: ['{self.spec.name}']")
        return prepare(params, self.spec, self.device, self.dtype, self.config.limits)

    def decode(self, batch: list[PreparedRequest]) -> list[DecodeResult | DecodeFailed]:
        """Decode requests that share one batch key; results come back in order. A request whose
        output is not finite gets a DecodeFailed in its place; the others are unaffected."""
        keys = {r.batch_key for r in batch}
        if len(keys) != 1:
            raise ValueError(f"a batch must share one (tier, shape, dtype) key, got {sorted(map(str, keys))}")
        quality = batch[0].quality
        # prepared under an earlier precision or device (a reconfigure in between): follow the engine
        latents = [r.latents.to(device=self.device, dtype=self.dtype) for r in batch]
        start = time.perf_counter()
        with torch.inference_mode(), self.fast_path.gate.use(quality == "high"):
            if quality == "lossless":
                decoded = [self._decode_each_alone(z) for z in latents]
            else:
                decoded = self._decode_together(latents)
            outputs = [self._finish(d, r) for d, r in zip(decoded, batch)]
        ms = (time.perf_counter() - start) * 1e3
        items = sum(r.items for r in batch)
        return [o if isinstance(o, DecodeFailed) else DecodeResult(o, ms, items) for o in outputs]

    @staticmethod
    def _finish(decoded: torch.Tensor, request: PreparedRequest):
        if not bool(torch.isfinite(decoded).all()):
            return DecodeFailed("latents", "the decoder produced NaN/Inf for these latents (overflow at this "
                                "precision?); try fp32 or check the latents' scaling")
        return postprocess(decoded, request.output)

    def _vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample

    def _decode_each_alone(self, z: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._vae_decode(item) for item in z.split(1)])

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
