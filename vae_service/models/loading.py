"""Decoder-only loading of diffusers VAEs (any diffusers autoencoder class).

The model is built with its parameters on the meta device (buffers are real: some are constants
computed at construction), the encoder and quant conv are dropped before any weight is read, and
only the tensors the remaining modules hold are read from the safetensors files. A decode service
therefore never materialises the encoder (about 40% of an image VAE's weights).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from safetensors import safe_open
from torch import nn

from vae_service.models.catalog import CLASSES, REFUSED, entry_for
from vae_service.models.errors import ModelLoadError
from vae_service.models.presets import PRESETS
from vae_service.models.spec import ENCODER_SIDE, ModelSpec, geometry_of, inspect_vae
from vae_service.names import hub_shaped, unknown_source

log = logging.getLogger(__name__)

_NORM_TYPES = (nn.GroupNorm, nn.LayerNorm, nn.BatchNorm2d)


@dataclass
class LoadedVae:
    vae: nn.Module
    spec: ModelSpec

    @classmethod
    def of(cls, vae: nn.Module, name: str = "vae") -> LoadedVae:
        """An in-memory VAE (tests, embedding callers), inspected like a loaded one."""
        return cls(vae.eval(), inspect_vae(vae, name))


def load_vae(source: str, *, name: str | None = None, seed: int = 0) -> LoadedVae:
    """Load a decoder-only VAE in fp32 on the CPU from a preset name, a local folder or a hub id."""
    if source in PRESETS:
        preset = PRESETS[source]
        vae, skipped = _build_decoder_only(preset.class_name, preset.config)
        _materialise(vae)
        _init_random(vae, seed)
        log.warning(
            "model '%s' has SEEDED RANDOM WEIGHTS: it decodes noise; give a diffusers VAE folder for images", source
        )
        config, class_name, random_weights = preset.config, preset.class_name, True
    else:
        folder = _resolve_folder(source)
        config = json.loads((folder / "config.json").read_text())
        class_name = config.get("_class_name", "")
        vae, skipped = _build_decoder_only(class_name, config)
        _load_decoder_weights(vae, folder)
        random_weights = False
    # Parameters keep requires_grad as diffusers builds them: inference mode needs no grads, and
    # matmul folds batch dims differently for weights that require grad (Mochi's decode differs in
    # the last bits), so a pipeline's `vae.decode` is reproduced only with the same flags.
    vae.eval()
    if entry_for(class_name).enable_tiling:
        vae.enable_tiling()  # its pipeline does, and its decode refuses to run otherwise
    spec = inspect_vae(vae, name or source, random_weights=random_weights, skipped_params=skipped)
    return LoadedVae(vae, spec)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters are created on the meta device (no memory, no initialisation compute); buffers
    stay real, since some are constants computed at construction (rotary tables, statistics)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _autoencoder_class(class_name: str) -> type:
    if class_name in REFUSED:
        raise ModelLoadError(f"model: VAE class '{class_name}' is not served: {REFUSED[class_name]}")
    cls = getattr(diffusers, class_name, None) if class_name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin) and hasattr(cls, "decode")):
        raise ModelLoadError(
            f"model: '{class_name}' is not a diffusers autoencoder with a decode method; "
            f"served classes include {sorted(CLASSES)}"
        )
    return cls


def _droppable(cls: type, config: dict) -> tuple[str, ...]:
    """The encoder-side modules this class decodes without: all of them, unless its decode reaches
    into them (Qwen-Image's `vae.decode` counts its encoder's convs), then none."""
    try:
        geometry_of(cls, config, ENCODER_SIDE)
    except ModelLoadError:
        geometry_of(cls, config)  # raises where the class does not trace at all
        log.info("%s's decode uses its encoder-side modules: they are loaded too", cls.__name__)
        return ()
    return ENCODER_SIDE


def _build_decoder_only(class_name: str, config: dict) -> tuple[nn.Module, int]:
    cls = _autoencoder_class(class_name)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        with _parameters_on_meta():
            vae = cls.from_config(config)
    except Exception as exc:
        raise ModelLoadError(f"model: {class_name} cannot be built from this config: {exc}") from exc
    skipped = 0
    for part in _droppable(cls, dict(vae.config)):
        module = getattr(vae, part, None)
        if isinstance(module, nn.Module):
            skipped += sum(p.numel() for p in module.parameters())
            setattr(vae, part, None)
    return vae, skipped


def _materialise(vae: nn.Module) -> None:
    for module in vae.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad
                )


def _init_random(vae: nn.Module, seed: int) -> None:
    """Deterministic weights per parameter name, independent of module order or diffusers version."""
    for module_name, module in vae.named_modules():
        is_norm = isinstance(module, _NORM_TYPES) or type(module).__name__.endswith(("RMS_norm", "RMSNorm"))
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}"
            with torch.no_grad():
                if is_norm:
                    p.fill_(0.0 if pname == "bias" else 1.0)
                    continue
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(full.encode()))
                fan_in = p[0].numel() if p.dim() > 1 else max(1, p.numel())
                if pname == "bias":
                    weight = getattr(module, "weight", None)
                    fan_in = weight[0].numel() if weight is not None and weight.dim() > 1 else fan_in
                bound = fan_in**-0.5
                p.copy_(torch.rand(p.shape, generator=gen) * (2 * bound) - bound)


def check_source(source: str) -> None:
    """What can be told about `source` without loading it (milliseconds; the CLI asks before Ray
    starts): a preset, a local diffusers folder whose config names a served class and which holds
    safetensors weights, or a name shaped like a hub id. Raises ModelLoadError naming `model`, with
    close matches for a mistyped preset or folder."""
    unknown = unknown_source(source)
    if unknown:
        raise ModelLoadError(unknown)
    path = Path(source).expanduser()
    if source in PRESETS or not path.exists():
        return  # a preset, or a hub id fetched where it is loaded (the replica)
    folder = _vae_folder(path)
    try:
        class_name = json.loads((folder / "config.json").read_text()).get("_class_name", "")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"model: {folder / 'config.json'} is not a diffusers config ({exc})") from None
    _autoencoder_class(class_name)
    _weight_files(folder)


def _vae_folder(path: Path) -> Path:
    for candidate in (path, path / "vae"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ModelLoadError(f"model: no config.json in '{path}' or '{path / 'vae'}'")


def _resolve_folder(source: str) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        return _vae_folder(path)
    if hub_shaped(source):
        return _download_from_hub(source)
    raise ModelLoadError(
        f"model: '{source}' is neither a preset ({', '.join(PRESETS)}), a local diffusers folder, "
        "nor a hub id (org/name)"
    )


# What a hub repo's VAE is: its config and weights at the root (a VAE repo) or under vae/ (a
# pipeline repo), nothing else. huggingface_hub matches these with fnmatch, whose `*` also matches
# `/`: "*.safetensors" pulled a pipeline's UNet and text encoders (tens of GB) to load its VAE. No
# pattern here has a `*`; shards are matched by their digits. fp16 copies only when there are no
# fp32 weights (_download_from_hub's second pass).
_WEIGHT_STEMS = {"fp32": "diffusion_pytorch_model", "fp16": "diffusion_pytorch_model.fp16"}
_SHARD = "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]"


def hub_patterns(variant: str = "fp32") -> list[str]:
    """allow_patterns for snapshot_download: the config and `variant`'s weights, at the root and
    under vae/ (what _resolve_folder and _weight_files read)."""
    stem = _WEIGHT_STEMS[variant]
    names = ["config.json", f"{stem}.safetensors", f"{stem}.safetensors.index.json", f"{stem}{_SHARD}.safetensors"]
    return names + [f"vae/{name}" for name in names]


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(repo_id, allow_patterns=hub_patterns("fp32")))
        folder = _vae_folder(root)
        if not _has_weights(folder):
            root = Path(snapshot_download(repo_id, allow_patterns=hub_patterns("fp16")))
    except ModelLoadError:
        raise
    except Exception as exc:  # offline, unknown repo, gated, ...: all mean "cannot load"
        raise ModelLoadError(
            f"model: could not fetch '{repo_id}' from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Without hub access, pass a local diffusers folder."
        ) from exc
    return _vae_folder(root)


def _has_weights(folder: Path) -> bool:
    try:
        _weight_files(folder)
    except ModelLoadError:
        return False
    return True


def _weight_files(folder: Path) -> list[Path]:
    for stem in ("diffusion_pytorch_model", "diffusion_pytorch_model.fp16"):
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / s for s in shards]
        single = folder / f"{stem}.safetensors"
        if single.is_file():
            return [single]
    raise ModelLoadError(
        f"model: no diffusion_pytorch_model*.safetensors in '{folder}' (pickled .bin weights are "
        "not loaded; convert them with save_pretrained(safe_serialization=True))"
    )


def _load_decoder_weights(vae: nn.Module, folder: Path) -> None:
    """Reads exactly the tensors the decoder-only model holds; fp32 (precision is the engine's)."""
    wanted, state = set(vae.state_dict()), {}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), not __contains__)
                if key in wanted:
                    t = f.get_tensor(key)
                    state[key] = t.float() if t.is_floating_point() else t
    try:
        vae.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"model: weights in '{folder}' do not match its config: {exc}") from exc
