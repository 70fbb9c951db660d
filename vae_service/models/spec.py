"""What the engine needs to know about a loaded VAE: its decode path, latent forms and
normalisation (models/catalog.py) and its geometry, traced from its modules (models/geometry.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from vae_service.models.catalog import ClassEntry, Media, entry_for
from vae_service.models.errors import ModelLoadError
from vae_service.models.geometry import Geometry, decode_geometry, encode_geometry, trace_geometry
from vae_service.models.normalisation import Normalisation
from vae_service.models.probe_cache import Architecture, ProbeCache, config_digest
from vae_service.models.probe_store import Codec

DEFAULT_DECODE_TIMESTEP = 0.0  # LTX pipelines' default `decode_timestep`
ENCODER_SIDE = ("encoder", "quant_conv")  # modules `encode` uses; a decode service drops them


@dataclass(frozen=True)
class ModelSpec:
    name: str
    class_name: str
    entry: ClassEntry
    geometry: Geometry
    normalisation: Normalisation
    timestep_conditioned: bool  # the decoder takes a decode timestep (LTX with a time embedder)
    random_weights: bool
    decoder_params: int
    skipped_params: int  # encoder + quant conv, never materialised

    @property
    def path(self) -> str:
        return self.entry.path

    @property
    def family(self) -> Media:
        """What a client gets: images [B, H, W, 3] or videos [B, T, H, W, 3]."""
        return self.entry.media or ("video" if self.geometry.video_latents else "image")

    @property
    def latent_channels(self) -> int:
        return self.geometry.latent_channels

    @property
    def spatial_scale(self) -> int:
        return self.geometry.spatial_scale

    def output_frames(self, latent_frames: int) -> int:
        return self.geometry.output_frames(latent_frames)

    def describe(self) -> dict:
        entry = self.entry
        forms = [
            "decoder layout " + ("[B, C, T, H, W] or [B, C, H, W]" if self.geometry.video_latents else "[B, C, H, W]")
        ]
        if entry.packed_patch:
            forms.append(f"packed [B, L, {self.latent_channels * entry.packed_patch**2}] with height/width")
        if entry.patchified:
            forms.append(f"2x2-patchified [B, {self.latent_channels * 4}, h, w]")
        found = {
            "decode_path": entry.path,
            "geometry": self.geometry.describe(),
            "latent_forms": forms,
            "normalisation": self.normalisation.describe(),
            "normalisation_of": entry.pipeline or "the config's scaling_factor/shift_factor",
            "pixels": entry.pixels,
        }
        if self.timestep_conditioned:
            found["decode_timestep_default"] = DEFAULT_DECODE_TIMESTEP
        if entry.notes:
            found["notes"] = list(entry.notes)
        return found


PIPELINE_STATISTICS_MAX = 4096  # values: the latent statistics pipelines read from the VAE, not weights


def pipeline_statistics(vae: nn.Module) -> dict[str, list]:
    """Buffers outside the encoder and decoder that pipelines read from `vae` before `decode`
    (FLUX.2's `bn.running_mean`/`running_var`, LTX's `latents_mean`/`latents_std`), as plain
    numbers in the decode dtype's values, so a remote stand-in VAE can offer them."""
    skip = ("decoder.", "encoder.", "post_quant_conv.", "quant_conv.")
    return {
        name: buffer.float().flatten().tolist()
        for name, buffer in vae.named_buffers()
        if not name.startswith(skip) and buffer.is_floating_point() and buffer.numel() <= PIPELINE_STATISTICS_MAX
    }


def jsonable_config(vae: nn.Module) -> dict:
    """The model's diffusers config as JSON values (what a pipeline reads from `vae.config`)."""
    return json.loads(json.dumps(dict(vae.config), default=str))


def decoded_pixels(vae: nn.Module, z: torch.Tensor, timestep: torch.Tensor | None = None) -> torch.Tensor:
    """`vae.decode(z)` as the pipelines call it, as a [B, 3, (T,) H, W] tensor."""
    out = vae.decode(z) if timestep is None else vae.decode(z, temb=timestep)
    out = out.sample if hasattr(out, "sample") else (out[0] if isinstance(out, tuple) else out)
    return out.transpose(1, 2) if entry_for(type(vae).__name__).frames_first_output else out


def _meta_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """What the service runs: causal decoders through diffusers' decoder forward per latent frame
    (as `_decode` does, without the encoder bookkeeping of `vae.decode`), others through `decode`."""
    if entry_for(type(vae).__name__).path == "causal_walk":
        from vae_service.models.wan_internals import diffusers_chunks

        return torch.cat(list(diffusers_chunks(vae, z)), 2)
    timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype) if timestep_conditioned(vae) else None
    return decoded_pixels(vae, z, timestep)


def timestep_conditioned(vae: nn.Module) -> bool:
    return getattr(getattr(vae, "decoder", None), "time_embedder", None) is not None


def dropped_parts(vae: nn.Module) -> tuple[str, ...]:
    return tuple(part for part in ENCODER_SIDE if getattr(vae, part, None) is None)


def meta_twin(vae: nn.Module) -> nn.Module:
    """The same architecture on the meta device, without the modules the model dropped: shapes
    without memory or compute."""
    return twin_of(type(vae), dict(vae.config), dropped_parts(vae))


def twin_of(cls: type, config: dict, dropped: tuple[str, ...] = ()) -> nn.Module:
    with torch.device("meta"):
        twin = cls.from_config(config)
    twin = nn.Module.to(twin, "meta")  # parameters some classes build with torch.Tensor(data), on the CPU
    for part in dropped:
        if hasattr(twin, part):
            setattr(twin, part, None)
    if entry_for(cls.__name__).enable_tiling:
        twin.enable_tiling()
    return twin.eval()


def geometry_of(cls: type, config: dict, dropped: tuple[str, ...] = ()) -> Geometry:
    """The geometry of `cls` built from `config` without the `dropped` modules, traced on the meta
    device (no weights), once per architecture (equal configs build equal modules), and kept on disk
    for other processes (models/probe_store.py). Raises ModelLoadError where it does not trace."""
    key = Architecture(cls, config_digest(config), dropped)
    config = json.loads(json.dumps(config, default=str))  # the plain values a saved config holds

    def kept(data: dict) -> Geometry:
        return decode_geometry(data, lambda: twin_of(cls, config, dropped), _meta_decode)

    return ProbeCache.process().get(
        key, "geometry", lambda: _trace_of(cls, config, dropped), Codec(encode_geometry, kept)
    )


def _trace_of(cls: type, config: dict, dropped: tuple[str, ...]) -> Geometry:
    hints = tuple(int(config[k]) for k in ("latent_channels", "z_dim") if isinstance(config.get(k), int))
    single_frame = entry_for(cls.__name__).media == "image"
    return trace_geometry(twin_of(cls, config, dropped), _meta_decode, hints, single_frame=single_frame)


def inspect_vae(
    vae: nn.Module,
    name: str,
    *,
    random_weights: bool = False,
    skipped_params: int = 0,
) -> ModelSpec:
    """The spec of a loaded VAE: its class's catalog entry, and its geometry traced on a meta twin."""
    class_name = type(vae).__name__
    entry = entry_for(class_name)
    config = dict(vae.config)
    geometry = geometry_of(type(vae), config, dropped_parts(vae))
    try:
        normalisation = entry.normalisation(config)
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"model: {class_name}'s config lacks its normalisation field {exc}") from exc
    return ModelSpec(
        name=name,
        class_name=class_name,
        entry=entry,
        geometry=geometry,
        normalisation=normalisation,
        timestep_conditioned=timestep_conditioned(vae),
        random_weights=random_weights,
        decoder_params=sum(p.numel() for p in vae.parameters()),
        skipped_params=skipped_params,
    )
