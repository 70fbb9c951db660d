"""Offline decode of whole datasets on Ray Data (`vae-service batch-decode`)."""

from vae_service.batch.job import BatchInputError, BatchSummary, decode_dataset, read_inputs, run_batch_decode
from vae_service.batch.latent_files import LatentFileError, load_latents

__all__ = [
    "BatchInputError",
    "BatchSummary",
    "LatentFileError",
    "decode_dataset",
    "load_latents",
    "read_inputs",
    "run_batch_decode",
]
