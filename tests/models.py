"""Small real diffusers VAEs for tests: built from the tiny preset configs with diffusers' own
initialisation, saved with save_pretrained, so loading goes through the real folder path."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL, AutoencoderKLWan

from vae_service.models.presets import PRESETS

FLUX_LIKE_TINY = dict(
    PRESETS["tiny-kl"].config,
    latent_channels=8,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def build_full_vae(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "kl":
        vae = AutoencoderKL(**PRESETS["tiny-kl"].config)
    elif kind == "flux":
        vae = AutoencoderKL(**FLUX_LIKE_TINY)
    elif kind == "kl64":
        vae = AutoencoderKL(**dict(PRESETS["tiny-kl"].config, block_out_channels=[64, 64, 64, 64], norm_num_groups=32))
    elif kind == "wan":
        vae = AutoencoderKLWan(**PRESETS["tiny-wan"].config)
    else:
        raise ValueError(kind)
    # diffusers initialises GroupNorm to identity; random affine params make the tests sharper
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return vae.eval()


# The first conv of the decoder scaled by this: latents of unit size decode finite in fp16, latents
# OVERFLOW_LATENTS times larger overflow fp16's 65504 while fp32 stays finite (its norms undo the
# scale): a model that needs the fp32 fallback only for some latents
OVERFLOW_SCALE = {"kl": 300.0, "flux": 300.0, "kl64": 300.0, "wan": 3000.0}
OVERFLOW_LATENTS = 1000.0


def overflowing_vae(kind: str, seed: int = 0) -> torch.nn.Module:
    vae = build_full_vae(kind, seed)
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(OVERFLOW_SCALE[kind])
    return vae


def save_vae(vae: torch.nn.Module, folder: Path) -> Path:
    vae.save_pretrained(folder, safe_serialization=True)
    return folder


def load_reference(folder: Path) -> torch.nn.Module:
    """diffusers' own `from_pretrained` of a saved folder: the reference for anything that loaded
    that folder (the service, an engine, a pipeline stage). Never the in-memory model that saved it:
    safetensors-loaded weights are not 64-byte aligned, and on some CPUs (AMD EPYC) an fp32 kernel
    takes another path for them, so every load of the folder (ours and diffusers' alike) differs
    from the in-memory model in the last bits. A copy of a loaded model is aligned again (see
    `at_precision`)."""
    class_name = json.loads((Path(folder) / "config.json").read_text())["_class_name"]
    return getattr(diffusers, class_name).from_pretrained(folder).eval()


def at_precision(vae: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`vae` itself in its own dtype (a deep copy would realign a loaded model's weights and give
    the in-memory model's bits, see `load_reference`), else a copy cast to `dtype` (the cast writes
    new tensors whatever the source's alignment, as the service's own cast does)."""
    if all(p.dtype == dtype for p in vae.parameters()):
        return vae
    return copy.deepcopy(vae).to(dtype)


def reference_decode(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """diffusers' own decode of each latent alone (a batch of one): the lossless contract."""
    with torch.inference_mode():
        return torch.cat([vae.decode(item).sample for item in z.split(1)])


@contextmanager
def torch_threads(n: int):
    """CPU results depend on the thread count: compute references with the server's."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
