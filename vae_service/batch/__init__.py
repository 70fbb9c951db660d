"""Offline decode of whole datasets on Ray Data (`vae-service batch-decode`)."""

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
