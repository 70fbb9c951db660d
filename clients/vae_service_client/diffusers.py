"""A diffusers drop-in VAE that decodes on vae-service: `pipe = SomePipeline(..., vae=RemoteVae(url))`
and the pipeline's own post-processing runs unchanged (`pip install "./clients[diffusers]"`).

What pipelines read from their VAE is mirrored from the served model: `config` (scaling and
shift factors, latent channels, block channels or scale factors, latent statistics), the
statistics some read as tensors (FLUX.2's `bn.running_mean`/`running_var`, LTX's
`latents_mean`/`latents_std`), `dtype` (the deployment's decode precision) and `device`.
`decode(z)` sends the latents as the pipeline hands them to `vae.decode` (already normalised, so
`scaling_factor: nil`) and returns the float output on the caller's device: `lossless` by default,
bit-identical to the served model's own `vae.decode`, and after `enable_tiling()` to its
`vae.enable_tiling(); vae.decode` (the request's `tiling`: "model", else "none", so a decode too
large for the server's memory bound raises PayloadTooLarge instead of answering tiled bits).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.models.autoencoders.vae import DecoderOutput

from vae_service_client.http_client import VaeClient

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class RemoteVae:
    """`model`: which model when one application serves several (routing by `model`);
    `quality`: `lossless` (default, bit-identical), `high` or `preview`; `priority`: the scheduler's
    class each decode asks for (realtime | interactive | bulk; None: the deployment's default, sent
    only when given); `token`, `timeout`, `retries`: as VaeClient's."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        token: str | None = None,
        quality: str = "lossless",
        timeout: float = 300.0,
        retries: int = 3,
        priority: str | None = None,
    ):
        self._client = VaeClient(url, timeout=timeout, retries=retries, token=token)
        health = self._client.health()
        if "models" in health:  # a routing ingress: pick the model
            if model is None and len(health["models"]) == 1:
                model = next(iter(health["models"]))
            if model not in health["models"]:
                raise ValueError(f"model: {model!r} is not served at {url}; served: {sorted(health['models'])}")
            health = health["models"][model]
        self.model, self.quality, self.priority = model, quality, priority
        self.use_tiling = False  # diffusers' attribute: enable_tiling() / disable_tiling()
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
        if self.priority is not None:
            options["priority"] = self.priority
        if temb is not None and self._timestep_conditioned:
            values = temb.flatten().tolist()
            if len(set(values)) > 1:  # one timestep per request: items with their own go alone
                parts = [
                    self.decode(z[i : i + 1], temb.flatten()[i : i + 1], return_dict=False)[0] for i in range(len(z))
                ]
                out = torch.cat(parts)
                return DecoderOutput(sample=out) if return_dict else (out,)
            options["decode_timestep"] = values[0]
        options["tiling"] = self._tiling()
        answer = self._client.decode(
            z.detach().cpu(), self.quality, "float", scaling_factor=None, shift_factor=None, **options
        )
        if answer.tiled and not self.use_tiling:  # a server that ignored `tiling`
            raise RuntimeError(
                "the service answered a tiled decode, but tiling is off on this RemoteVae "
                "(enable_tiling() to accept it)"
            )
        # the wire's arrays are read-only views of the answer's bytes: torch wants memory it may write
        out = torch.from_numpy(np.require(answer.output, requirements="W")).to(self.device, self.dtype)
        if z.dim() == 5 and out.dim() == 4:  # an image model with a video decoder (Qwen-Image): one frame
            out = out.unsqueeze(2)
        return DecoderOutput(sample=out) if return_dict else (out,)

    def encode(self, *args, **kwargs):
        raise NotImplementedError(
            "RemoteVae decodes only: vae-service serves decoders. For image-to-image or inpainting, encode "
            "with a local VAE (e.g. AutoencoderKL.from_pretrained(repo, subfolder='vae')) and pass the latents."
        )

    def _tiling(self) -> str:
        """The request's `tiling`: with tiling on, `lossless` is the class's own tiled decode (as the
        local `vae.enable_tiling(); vae.decode`) and other tiers tile as the server's bound says;
        off, nothing is tiled (413 where the whole decode is over the server's bound)."""
        if not self.use_tiling:
            return "none"
        return "model" if self.quality == "lossless" else "auto"

    def enable_tiling(self, use_tiling: bool = True, **tile_sizes) -> None:
        """Decode as the local VAE's `enable_tiling()` would: its class's own tiled decode, with the
        tile sizes of the served model's config (others cannot be asked for: they raise)."""
        if tile_sizes:
            raise ValueError(
                f"{sorted(tile_sizes)}: the service tiles with the served model's own tile sizes; "
                "call enable_tiling() without them"
            )
        self.use_tiling = bool(use_tiling)

    def disable_tiling(self) -> None:
        self.use_tiling = False

    def enable_slicing(self, *args, **kwargs) -> None:
        """The service decodes `lossless` items one by one already."""

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RemoteVae({self._client._http.base_url}, model={self.served_model!r}, dtype={self.dtype})"
