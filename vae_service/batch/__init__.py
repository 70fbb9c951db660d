"""Offline decode of whole datasets on Ray Data (`vae-service batch-decode`).

Its names load on first use: `vae-service decode` reads latents files (latent_files) and names
its outputs (outputs) with this package's modules, which need neither torch nor Ray; the job's
modules (job, stage) import the engine, which takes seconds."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vae_service.batch.job import (
        BatchInputError,
        BatchSummary,
        Inputs,
        decode_dataset,
        list_inputs,
        read_inputs,
        run_batch_decode,
    )
    from vae_service.batch.latent_files import LatentFileError, load_latents

__all__ = [
    "BatchInputError",
    "BatchSummary",
    "Inputs",
    "LatentFileError",
    "decode_dataset",
    "list_inputs",
    "load_latents",
    "read_inputs",
    "run_batch_decode",
]
_LATENT_FILES = ("LatentFileError", "load_latents")  # the rest are the job's


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _LATENT_FILES:
        from vae_service.batch import latent_files as module
    else:
        from vae_service.batch import job as module
    return getattr(module, name)
