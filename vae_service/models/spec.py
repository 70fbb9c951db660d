"""What the engine needs to know about a loaded VAE, read from its diffusers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["image", "video"]

# diffusers classes we can serve, and whether their latents are images or videos.
SUPPORTED_CLASSES: dict[str, Family] = {"AutoencoderKL": "image", "AutoencoderKLWan": "video"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    class_name: str
    family: Family
    latent_channels: int
    spatial_scale: int
    temporal_scale: int  # 1 for image VAEs
    scaling_factor: float | None
    shift_factor: float | None
    latents_mean: tuple[float, ...] | None  # per-channel (Wan)
    latents_std: tuple[float, ...] | None
    random_weights: bool
    decoder_params: int
    skipped_params: int  # encoder + quant conv, never materialised

    @classmethod
    def from_config(
        cls,
        name: str,
        class_name: str,
        config: dict,
        *,
        random_weights: bool,
        decoder_params: int,
        skipped_params: int,
    ) -> ModelSpec:
        family = SUPPORTED_CLASSES[class_name]
        if family == "video":
            return cls(
                name=name,
                class_name=class_name,
                family=family,
                latent_channels=int(config["z_dim"]),
                spatial_scale=int(config.get("scale_factor_spatial") or 8),
                temporal_scale=int(config.get("scale_factor_temporal") or 4),
                scaling_factor=None,
                shift_factor=None,
                latents_mean=tuple(config["latents_mean"]),
                latents_std=tuple(config["latents_std"]),
                random_weights=random_weights,
                decoder_params=decoder_params,
                skipped_params=skipped_params,
            )
        return cls(
            name=name,
            class_name=class_name,
            family=family,
            latent_channels=int(config["latent_channels"]),
            spatial_scale=2 ** (len(config["block_out_channels"]) - 1),
            temporal_scale=1,
            scaling_factor=config.get("scaling_factor"),
            shift_factor=config.get("shift_factor"),
            latents_mean=None,
            latents_std=None,
            random_weights=random_weights,
            decoder_params=decoder_params,
            skipped_params=skipped_params,
        )

    def output_frames(self, latent_frames: int) -> int:
        """Wan decodes the first latent frame to one frame and each later one to `temporal_scale`."""
        return 1 + self.temporal_scale * (latent_frames - 1)
