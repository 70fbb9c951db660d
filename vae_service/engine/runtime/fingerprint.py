"""What decides the bits an engine decodes to, as one digest: two engines with equal fingerprints
decode any tile to the same bits, so a tile decoded on one may be blended into another's answer.

It covers the model (class, config), its weights (a digest of every tensor the decoder holds), the
decode precision, the device kind (on CUDA the GPU's name: kernels differ between GPUs), the fast
path's active rewrites and their backends, on CPU torch's thread count (reductions split by it),
and the torch and diffusers versions (their kernels and modules). During a rolling update, or on CPU
nodes with other core counts, replicas of one deployment can differ in any of these.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass

import diffusers
import torch
from torch import nn

from vae_service.models.probe_cache import config_digest

DIGEST_CHARS = 16


def weights_digest(vae: nn.Module) -> str:
    """Every parameter and buffer by name, dtype, shape and bytes (the weights the engine decodes
    with, after its precision's cast). ~0.3 s per 200 MB here."""
    digest = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    for name, tensor in sorted(vae.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    model: str  # class name and a digest of its config
    weights: str
    precision: str
    device: str  # "cpu", or "cuda:<GPU name>"
    rewrites: tuple[tuple[str, str], ...]  # active fast-path rewrites and their backends
    cpu_threads: int | None
    versions: str

    @classmethod
    def of(
        cls,
        vae: nn.Module,
        config: dict,
        precision: str,
        device: torch.device,
        rewrites: dict[str, str],
        cpu_threads: int | None,
    ) -> Fingerprint:
        kind = f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
        return cls(
            f"{type(vae).__name__}:{config_digest(config)}",
            weights_digest(vae),
            precision,
            kind,
            tuple(sorted(rewrites.items())),
            cpu_threads,
            f"torch {torch.__version__}, diffusers {diffusers.__version__}",
        )

    @functools.cached_property  # read by every admission and every tile offered
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=DIGEST_CHARS // 2).hexdigest()

    def describe(self) -> dict:
        return {"digest": self.digest, **asdict(self), "rewrites": dict(self.rewrites)}
