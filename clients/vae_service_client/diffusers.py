"""A diffusers drop-in VAE that decodes on vae-service: `pipe = SomePipeline(..., vae=RemoteVae(url))`
and the pipeline's own post-processing runs unchanged (`pip install "./clients[diffusers]"`).

What pipelines read from their VAE is mirrored from the served model: `config` (scaling and
shift factors, latent channels, block channels or scale factors, latent statistics), the
statistics some read as tensors (FLUX.2's `bn.running_mean`/`running_var`, LTX's
`latents_mean`/`latents_std`), `dtype` (the deployment's decode precision) and `device`.
`decode(z)` sends the latents as the pipeline hands them to `vae.decode` (already normalised, so
`scaling_factor: nil`) and returns the float output on the caller's device: `lossless` by default,
bit-identical to the served model's own `vae.decode`.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.models.autoencoders.vae import DecoderOutput

from vae_service_client.http_client import VaeClient

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class RemoteVae:
    """`model`: which model when one application serves several (routing by `model`);
    `quality`: `lossless` (default, bit-identical), `high` or `preview`; `token`, `timeout`,
    `retries`: as VaeClient's."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        token: str | None = None,
        quality: str = "lossless",
        timeout: float = 300.0,
        retries: int = 3,
    ):
        self._client = VaeClient(url, timeout=timeout, retries=retries, token=token)
        health = self._client.health()
        if "models" in health:  # a routing ingress: pick the model
            if model is None and len(health["models"]) == 1:
                model = next(iter(health["models"]))
            if model not in health["models"]:
                raise ValueError(f"model: {model!r} is not served at {url}; served: {sorted(health['models'])}")
            health = health["models"][model]
        self.model, self.quality = model, quality
        self.served_model = health["model"]
        self.config = FrozenDict(health["config"])
        self.dtype: torch.dtype = _DTYPES[health["precision"]]
        self.device = torch.device("cpu")
        self._timestep_conditioned = "decode_timestep_default" in health
        for name, values in health.get("statistics", {}).items():
            self._set_statistic(name, torch.tensor(values, dtype=self.dtype))

    def _set_statistic(self, dotted: str, value: torch.Tensor) -> None:
        """`bn.running_mean` -> self.bn.running_mean, as the pipelines reach for it."""
        *path, leaf = dotted.split(".")
        owner: Any = self
        for part in path:
            if not hasattr(owner, part):
                setattr(owner, part, types.SimpleNamespace())
            owner = getattr(owner, part)
        setattr(owner, leaf, value)

    # ---- what pipelines call ------------------------------------------------------------------
    def to(self, *args, **kwargs) -> RemoteVae:
        """Moves where outputs land; the decode precision is the deployment's and cannot change."""
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.dtype) and arg != self.dtype:
                raise ValueError(
                    f"dtype: the service decodes in {self.dtype} (its deployment's decode_precision); "
                    "serve another deployment for another precision"
                )
            if isinstance(arg, str | torch.device):
                self.device = torch.device(arg)
        return self

    def eval(self) -> RemoteVae:
        return self

    def modules(self):
        """Pipelines look for offloading hooks on a component's modules; a remote VAE has none."""
        yield self

    def decode(self, z: torch.Tensor, temb: torch.Tensor | None = None, return_dict: bool = True, **kwargs):
        """`z`: the latents `vae.decode` would take (already normalised). `temb`: the decode
        timestep of timestep-conditioned decoders (one value per item)."""
        options = {"model": self.model} if self.model else {}
        if temb is not None and self._timestep_conditioned:
            values = temb.flatten().tolist()
            if len(set(values)) > 1:  # one timestep per request: items with their own go alone
                parts = [
                    self.decode(z[i : i + 1], temb.flatten()[i : i + 1], return_dict=False)[0] for i in range(len(z))
                ]
                out = torch.cat(parts)
                return DecoderOutput(sample=out) if return_dict else (out,)
            options["decode_timestep"] = values[0]
        answer = self._client.decode(
            z.detach().cpu(), self.quality, "float", scaling_factor=None, shift_factor=None, **options
        )
        out = torch.from_numpy(answer.output).to(self.device, self.dtype)
        if z.dim() == 5 and out.dim() == 4:  # an image model with a video decoder (Qwen-Image): one frame
            out = out.unsqueeze(2)
        return DecoderOutput(sample=out) if return_dict else (out,)

    def encode(self, *args, **kwargs):
        raise NotImplementedError(
            "RemoteVae decodes only: vae-service serves decoders. For image-to-image or inpainting, encode "
            "with a local VAE (e.g. AutoencoderKL.from_pretrained(repo, subfolder='vae')) and pass the latents."
        )

    def enable_tiling(self, *args, **kwargs) -> None:
        """The service tiles by its own memory bound (`limits.max_decode_bytes`)."""

    def enable_slicing(self, *args, **kwargs) -> None:
        """The service decodes `lossless` items one by one already."""

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RemoteVae({self._client._http.base_url}, model={self.served_model!r}, dtype={self.dtype})"
