"""Latents stored as files: `.npy` (never with pickled objects) or `.safetensors` (one tensor, or
the one named by `key`), in a local folder or object storage (a URI or a storage Location:
vae_service/storage). Shared by `vae-service decode` and offline batch decoding.

Errors name the file and say what is wrong with it in a latents file's terms. NumPy's own message
for a file that is no .npy at all suggests loading it "unsafely using allow_pickle": a hint that
runs whatever code the file carries, so it is never passed on."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np

from vae_service.storage import Location, LocationError, open_location

LATENT_SUFFIXES = (".npy", ".safetensors")


class LatentFileError(ValueError):
    """A latents file that cannot be read; the message names the file."""


def _npy_header(name: str, f) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a .npy file declares (its data is not read)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        shape, _, dtype = (
            fmt.read_array_header_1_0(f) if version == (1, 0) else fmt.read_array_header_2_0(f)
        )  # fmt: skip
    except ValueError:
        raise LatentFileError(f"{name}: not a .npy file (no NumPy array header)") from None
    if dtype.hasobject:
        raise LatentFileError(f"{name}: holds Python objects (dtype {dtype}), not a numeric array of latents")
    return tuple(shape), dtype


def _safetensors_header(name: str, f) -> dict[str, list[int]]:
    """Tensor name -> shape, from a .safetensors file's JSON header (its data is not read)."""
    size = f.read(8)
    if len(size) != 8:
        raise LatentFileError(f"{name}: not a .safetensors file (shorter than its header)")
    (length,) = struct.unpack("<Q", size)
    try:
        header = json.loads(f.read(min(length, 100 * 2**20)))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise LatentFileError(f"{name}: not a .safetensors file (its header is not valid)") from None


def _chosen(name: str, names, key: str | None) -> str:
    names = sorted(names)
    if key is not None:
        if key not in names:
            raise LatentFileError(f"{name}: no tensor named {key!r}; it holds {names}")
        return key
    if len(names) != 1:
        raise LatentFileError(f"{name} holds {names}; choose one with --key")
    return names[0]


def _source(path: str | Path | Location) -> Path | Location:
    """A local file as a Path; a URI (s3://, gs://, file://) or a store's Location as a Location."""
    if isinstance(path, Location):
        return Path(path.path) if path.local else path
    if isinstance(path, str) and "://" in path:
        try:
            return _source(open_location(path))
        except LocationError as exc:  # a URI no store reads: said in one line, as a bad file is
            raise LatentFileError(str(exc)) from None
    return Path(path)


def _open(source: Path | Location):
    return source.open("rb") if isinstance(source, Path) else source.open_input()


def latents_shape(path: str | Path | Location, key: str | None = None) -> tuple[int, ...]:
    """The shape of the latents a file holds, from its header alone (batch-decode plans every
    input's outputs before decoding any; from a store, only the header's bytes are read)."""
    source = _source(path)
    name = source.name
    try:
        if source.suffix == ".npy":
            with _open(source) as f:
                return _npy_header(name, f)[0]
        if source.suffix == ".safetensors":
            with _open(source) as f:
                shapes = _safetensors_header(name, f)
            return tuple(shapes[_chosen(name, shapes, key)])
    except OSError as exc:
        raise LatentFileError(f"{name}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    raise LatentFileError(f"{name}: expected one of {list(LATENT_SUFFIXES)}")


def _safetensors_tensor(source: Path | bytes, chosen: str):
    """The tensor `chosen` of a local .safetensors file (memory-mapped: only that tensor is read)
    or of a stored one's bytes, as NumPy's array: `vae-service decode` then never imports torch
    (seconds). A tensor of bfloat16, which NumPy lacks, is read by torch: such latents go on the
    wire as bfloat16, at half float32's size."""
    from safetensors import safe_open
    from safetensors.numpy import load

    try:
        if isinstance(source, Path):
            with safe_open(str(source), framework="numpy") as f:
                return f.get_tensor(chosen)
        return load(source)[chosen]
    except (KeyError, TypeError):  # NumPy has no bfloat16
        from safetensors.torch import load as load_torch

        if isinstance(source, Path):
            with safe_open(str(source), framework="pt") as f:
                return f.get_tensor(chosen)
        return load_torch(source)[chosen]


def load_latents(path: str | Path | Location, key: str | None = None):
    """-> a numpy array (.npy, and .safetensors without bfloat16) or a torch tensor (.safetensors
    holding bfloat16: _safetensors_tensor). A file in a store is read whole into memory first."""
    source = _source(path)
    name = source.name
    if source.suffix not in LATENT_SUFFIXES:
        raise LatentFileError(f"{name}: expected one of {list(LATENT_SUFFIXES)}")
    try:
        local = isinstance(source, Path)
        data = None if local else source.read_bytes()
        if source.suffix == ".npy":
            with _open(source) if local else io.BytesIO(data) as f:
                shape, dtype = _npy_header(name, f)
            try:
                return np.load(source if local else io.BytesIO(data), allow_pickle=False)
            except ValueError:  # the header was fine: the data is short
                raise LatentFileError(
                    f"{name}: truncated (its header declares {dtype} {list(shape)}, the data is shorter)"
                ) from None
        if source.suffix == ".safetensors":
            with _open(source) if local else io.BytesIO(data) as f:
                chosen = _chosen(name, _safetensors_header(name, f), key)
            return _safetensors_tensor(source if local else data, chosen)
    except LatentFileError:
        raise
    except OSError as exc:
        raise LatentFileError(f"{name}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except Exception as exc:  # safetensors raises several kinds for a damaged file
        raise LatentFileError(f"{name}: not a readable {source.suffix} latents file ({exc})") from None
    raise LatentFileError(f"{name}: expected one of {list(LATENT_SUFFIXES)}")
