"""Latents stored as files: `.npy` (never with pickled objects) or `.safetensors` (one tensor, or
the one named by `key`). Shared by `vae-service decode` and offline batch decoding.

Errors name the file and say what is wrong with it in a latents file's terms. NumPy's own message
for a file that is no .npy at all suggests loading it "unsafely using allow_pickle": a hint that
runs whatever code the file carries, so it is never passed on."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

LATENT_SUFFIXES = (".npy", ".safetensors")


class LatentFileError(ValueError):
    """A latents file that cannot be read; the message names the file."""


def _npy_header(path: Path, f) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a .npy file declares (its data is not read)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        shape, _, dtype = (
            fmt.read_array_header_1_0(f) if version == (1, 0) else fmt.read_array_header_2_0(f)
        )  # fmt: skip
    except ValueError:
        raise LatentFileError(f"{path.name}: not a .npy file (no NumPy array header)") from None
    if dtype.hasobject:
        raise LatentFileError(f"{path.name}: holds Python objects (dtype {dtype}), not a numeric array of latents")
    return tuple(shape), dtype


def _safetensors_header(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a .safetensors file's JSON header (its data is not read)."""
    with path.open("rb") as f:
        size = f.read(8)
        if len(size) != 8:
            raise LatentFileError(f"{path.name}: not a .safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", size)
        try:
            header = json.loads(f.read(min(length, 100 * 2**20)))
            return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, AttributeError):
            raise LatentFileError(f"{path.name}: not a .safetensors file (its header is not valid)") from None


def _chosen(path: Path, names, key: str | None) -> str:
    names = sorted(names)
    if key is not None:
        if key not in names:
            raise LatentFileError(f"{path.name}: no tensor named {key!r}; it holds {names}")
        return key
    if len(names) != 1:
        raise LatentFileError(f"{path.name} holds {names}; choose one with --key")
    return names[0]


def latents_shape(path: str | Path, key: str | None = None) -> tuple[int, ...]:
    """The shape of the latents a file holds, from its header alone (batch-decode plans every
    input's outputs before decoding any)."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            with path.open("rb") as f:
                return _npy_header(path, f)[0]
        if path.suffix == ".safetensors":
            shapes = _safetensors_header(path)
            return tuple(shapes[_chosen(path, shapes, key)])
    except OSError as exc:
        raise LatentFileError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    raise LatentFileError(f"{path.name}: expected one of {list(LATENT_SUFFIXES)}")


def load_latents(path: str | Path, key: str | None = None):
    """-> a numpy array (.npy) or a torch tensor (.safetensors, any dtype it holds)."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            with path.open("rb") as f:
                shape, dtype = _npy_header(path, f)
            try:
                return np.load(path, allow_pickle=False)
            except ValueError:  # the header was fine: the data is short
                raise LatentFileError(
                    f"{path.name}: truncated (its header declares {dtype} {list(shape)}, the data is shorter)"
                ) from None
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            name = _chosen(path, _safetensors_header(path), key)
            return load_file(str(path))[name]
    except LatentFileError:
        raise
    except OSError as exc:
        raise LatentFileError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # safetensors raises several kinds for a damaged file
        raise LatentFileError(f"{path.name}: not a readable {path.suffix} latents file ({exc})") from None
    raise LatentFileError(f"{path.name}: expected one of {list(LATENT_SUFFIXES)}")
