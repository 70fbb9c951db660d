"""Serve composition: the handle method's arguments (a torch tensor or numpy array, plus the
/decode keys as keyword arguments) -> DecodeRequest, and a DecodeResult -> the /decode response
fields with `output` as a numpy array (bf16 as float32) or a list of encoded bytes."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from vae_service.engine.errors import InvalidInput
from vae_service.engine.request import DecodeRequest
from vae_service.engine.result import DecodeResult
from vae_service.protocol.msgpack_decode import response_of
from vae_service.protocol.tensors import from_numpy, to_numpy
from vae_service_client.messages import REQUEST_KEYS


def request_from_call(latents, resident_device: torch.device | None = None, **options) -> DecodeRequest:
    """Tensors come to the host, except those already on `resident_device` (the decoding one): a compiled
    graph hands latents over GPU to GPU, and they stay there."""
    unknown = sorted(set(options) - set(REQUEST_KEYS))
    if unknown:
        raise InvalidInput(unknown[0], f"unknown argument; allowed: {sorted(set(REQUEST_KEYS) - {'latents'})}")
    if isinstance(latents, np.ndarray):
        latents = from_numpy(latents)
    if isinstance(latents, torch.Tensor):
        latents = latents.detach()
        if latents.device != resident_device:
            latents = latents.cpu()
    return DecodeRequest(latents, **options)


def result_to_call(result: DecodeResult) -> dict:
    out = result.output if isinstance(result.output, list) else to_numpy(result.output)
    response = response_of(result, out)
    return {f.name: getattr(response, f.name) for f in fields(response) if f.name != "item_index"}
