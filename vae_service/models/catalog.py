"""What the service knows about each diffusers autoencoder class beyond its modules: which decode
path serves it, the latent normalisation its pipeline undoes before `vae.decode`, the latent
forms its pipelines hand over, and how its pixels are scaled. Geometry is never here: it is
traced from the modules (models/geometry.py).

Paths:
- `image_kl`: diffusers' `Decoder` behind a post-quant conv (AutoencoderKL, AutoencoderKLFlux2):
  both tiers, the image fast path, spatial tiling.
- `causal_walk`: Wan-style causal 3-D decoders (Wan2.1, Wan2.2, Qwen-Image), decoded latent frame
  by latent frame by our own walk: both tiers, streaming, tiling.
- `generic`: any other class with a `decode` from latents to pixels: its own `decode`, each item
  alone (lossless; a `high` request is answered by it and says so).

A class missing from the table is served on the generic path when its geometry traces, with the
config's `scaling_factor`/`shift_factor` (when it has them) as its normalisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from vae_service.models.normalisation import Normalisation, factors

Path = Literal["image_kl", "causal_walk", "generic"]
Media = Literal["image", "video"]
PixelRange = Literal["signed", "imagenet"]  # [-1, 1]; ImageNet-normalised


def _config_factors(config: dict) -> Normalisation:
    return factors(config.get("scaling_factor"), config.get("shift_factor"))


def _sd_family(config: dict) -> Normalisation:
    """SDXL's pipeline: `z * std / scaling + mean` when the config carries latents_mean/std
    (Playground-style VAEs), else `z / scaling` (+ FLUX.1's shift)."""
    if config.get("latents_mean") is not None and config.get("latents_std") is not None:
        return Normalisation(
            "mean_std_scaled",
            config["scaling_factor"],
            mean=tuple(config["latents_mean"]),
            std=tuple(config["latents_std"]),
        )
    return _config_factors(config)


def _mean_inv_std(config: dict) -> Normalisation:
    return Normalisation(
        "mean_inv_std",
        mean=tuple(config["latents_mean"]),
        std=tuple(config["latents_std"]),
    )


def _ltx(in_fp32: bool) -> Callable[[dict], Normalisation]:
    # statistics are the model's `latents_mean`/`latents_std` buffers, loaded with its weights
    return lambda config: Normalisation("mean_std_scaled", float(config.get("scaling_factor", 1.0)), in_fp32=in_fp32)


def _mochi(config: dict) -> Normalisation:
    if config.get("latents_mean") is None:
        return Normalisation("factors", config["scaling_factor"], in_fp32=True)
    return Normalisation(
        "mean_std_scaled",
        config["scaling_factor"],
        mean=tuple(config["latents_mean"]),
        std=tuple(config["latents_std"]),
        in_fp32=True,
    )


COSMOS_SIGMA_DATA = 0.5  # the EDM scheduler's default, which Cosmos' pipelines divide by


def _cosmos(config: dict) -> Normalisation:
    if config.get("latents_mean") is None:
        return Normalisation("factors", COSMOS_SIGMA_DATA, in_fp32=True)
    return Normalisation(
        "mean_std_scaled",
        COSMOS_SIGMA_DATA,
        mean=tuple(config["latents_mean"]),
        std=tuple(config["latents_std"]),
        in_fp32=True,
        per_frame=True,
    )


def _mean_std(in_fp32: bool) -> Callable[[dict], Normalisation]:
    return lambda config: Normalisation(
        "mean_std", mean=tuple(config["latents_mean"]), std=tuple(config["latents_std"]), in_fp32=in_fp32
    )


def _reciprocal(config: dict) -> Normalisation:
    return Normalisation("reciprocal_scaling", config["scaling_factor"])


@dataclass(frozen=True)
class ClassEntry:
    path: Path = "generic"
    normalisation: Callable[[dict], Normalisation] = _config_factors
    pipeline: str = ""  # the diffusers pipeline whose arithmetic the default normalisation follows
    media: Media | None = None  # None: video when the decoder takes video latents
    packed_patch: int | None = None  # token sequences [B, L, C * p * p] with height/width accepted
    patchified: bool = False  # 2x2-patchified [B, 4C, h, w] accepted (FLUX.2)
    raw_is_decoded_as_is: bool = False  # latents in the decoder's own layout skip the normalisation
    frames_first_output: bool = False  # decode returns [B, T, 3, H, W]
    pixels: PixelRange = "signed"
    enable_tiling: bool = False  # the pipeline turns diffusers' tiling on (decode refuses otherwise)
    notes: tuple[str, ...] = field(default=())


CLASSES: dict[str, ClassEntry] = {
    "AutoencoderKL": ClassEntry("image_kl", _sd_family, "StableDiffusion(XL)Pipeline, FluxPipeline", packed_patch=2),
    "AutoencoderKLFlux2": ClassEntry(
        "image_kl",
        lambda config: Normalisation("batch_norm"),
        "Flux2Pipeline",
        packed_patch=2,
        patchified=True,
        raw_is_decoded_as_is=True,
        notes=("raw [B, 32, H, W] latents (Flux2KleinPipeline's latent output) are decoded as sent",),
    ),
    "AutoencoderKLWan": ClassEntry("causal_walk", _mean_inv_std, "WanPipeline"),
    "AutoencoderKLQwenImage": ClassEntry("causal_walk", _mean_inv_std, "QwenImagePipeline", "image", packed_patch=2),
    "AutoencoderKLQwenImage21": ClassEntry("generic", _mean_std(False), "QwenImage21Pipeline", "image", packed_patch=1),
    "AutoencoderKLHunyuanVideo": ClassEntry(
        notes=("diffusers decodes more than 4 latent frames in overlapping temporal tiles by default",),
        pipeline="HunyuanVideoPipeline",
    ),
    "AutoencoderKLHunyuanVideo15": ClassEntry(pipeline="HunyuanVideo15Pipeline"),
    "AutoencoderKLHunyuanImage": ClassEntry(pipeline="HunyuanImagePipeline"),
    "AutoencoderKLHunyuanImageRefiner": ClassEntry(pipeline="HunyuanImageRefinerPipeline", media="image"),
    "AutoencoderKLLTXVideo": ClassEntry(
        normalisation=_ltx(in_fp32=True),
        pipeline="LTXPipeline",
        notes=("timestep-conditioned decoders take `decode_timestep` (default 0.0, the pipeline's)",),
    ),
    "AutoencoderKLLTX2Video": ClassEntry(
        normalisation=_ltx(in_fp32=False),
        pipeline="LTX2Pipeline",
        notes=("LTX2Pipeline's latent output is already denormalised: send `scaling_factor: nil`",),
    ),
    "AutoencoderKLCogVideoX": ClassEntry(normalisation=_reciprocal, pipeline="CogVideoXPipeline"),
    "AutoencoderKLMochi": ClassEntry(normalisation=_mochi, pipeline="MochiPipeline"),
    "AutoencoderDC": ClassEntry(pipeline="SanaPipeline"),
    "AutoencoderKLCosmos": ClassEntry(normalisation=_cosmos, pipeline="CosmosTextToWorldPipeline"),
    "AutoencoderKLMiniMaxH3": ClassEntry(
        normalisation=_mean_std(True), pipeline="MiniMax-H3 (modular)", pixels="imagenet"
    ),
    "AutoencoderKLAllegro": ClassEntry(
        normalisation=_reciprocal, pipeline="AllegroPipeline", frames_first_output=True, enable_tiling=True
    ),
    "AutoencoderKLMagvit": ClassEntry(normalisation=_reciprocal, pipeline="EasyAnimatePipeline"),
}

REFUSED: dict[str, str] = {
    "ConsistencyDecoderVAE": "decodes by sampling with random noise, so no decode is reproducible",
    "AutoencoderKLTemporalDecoder": "its decode needs num_frames and mixes frames by chunk (not served yet)",
}

# ImageNet's per-channel pixel statistics, which MiniMax-H3's decoder outputs are normalised by
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def entry_for(class_name: str) -> ClassEntry:
    return CLASSES.get(class_name, ClassEntry())
