"""Latents stored as files: `.npy` (never with pickled objects) or `.safetensors` (one tensor, or
the one named by `key`). Shared by `vae-service decode` and offline batch decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LATENT_SUFFIXES = (".npy", ".safetensors")


class LatentFileError(ValueError):
    """A latents file that cannot be read; the message names the file."""


def load_latents(path: str | Path, key: str | None = None):
    """-> a numpy array (.npy) or a torch tensor (.safetensors, any dtype it holds)."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            if key is not None:
                if key not in tensors:
                    raise LatentFileError(f"{path.name}: no tensor named {key!r}; it holds {sorted(tensors)}")
                return tensors[key]
            if len(tensors) != 1:
                raise LatentFileError(f"{path.name} holds {sorted(tensors)}; choose one with --key")
            return next(iter(tensors.values()))
    except LatentFileError:
        raise
    except Exception as exc:  # numpy and safetensors raise many kinds for a damaged file
        raise LatentFileError(f"{path.name}: not a readable {path.suffix} latents file ({exc})") from None
    raise LatentFileError(f"{path.name}: expected one of {list(LATENT_SUFFIXES)}")
