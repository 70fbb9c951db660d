"""Every way in -> the engine's DecodeRequest: a msgpack /decode body, a gRPC DecodeRequest
message, a handle call's arguments. The fields are the wire schema's (vae_service_client.messages);
values are checked by DecodeRequest itself. (Hugging Face remote-decode: protocol/hf_remote.py.)

Latent factors arrive in three states, mapped here and nowhere else: a key absent (or the client's
UNSET) leaves the model's own; nil (None) for either says the latents are already scaled
(`latents_scaled`: only a factor given as a number applies); a number replaces the model's."""

from __future__ import annotations

import numpy as np
import torch

from vae_service.engine.request.decode_request import DecodeRequest
from vae_service.engine.request.errors import InvalidInput
from vae_service.protocol.msgpack_body import check_body_present, check_content_type, unpack_body
from vae_service.protocol.tensors import from_numpy, to_torch
from vae_service_client.errors import did_you_mean
from vae_service_client.messages import REQUEST_KEYS, UNSET, request_fields, request_fields_from_proto

FACTORS = ("scaling_factor", "shift_factor")


def engine_fields(fields: dict) -> dict:
    """Wire fields -> DecodeRequest's keyword arguments (the factors' three states, above)."""
    out = {k: v for k, v in fields.items() if k not in FACTORS or (v is not None and v is not UNSET)}
    if any(k in fields and fields[k] is None for k in FACTORS):
        out["latents_scaled"] = True
    return out


def request_from_fields(fields: dict) -> DecodeRequest:
    """Wire fields (`latents` a WireTensor) -> DecodeRequest; msgpack and gRPC share it."""
    return DecodeRequest(**engine_fields({**fields, "latents": to_torch(fields["latents"])}))


def parse_decode_body(body: bytes, content_type: str | None, max_request_bytes: int) -> DecodeRequest:
    check_body_present(body)
    check_content_type(content_type)
    return request_from_fields(request_fields(unpack_body(body, max_request_bytes)))


def request_from_proto(msg, stream: bool = False) -> DecodeRequest:
    """A vae_service.v1.DecodeRequest; `stream` for DecodeFrames (frames handed over as decoded)."""
    fields = request_fields_from_proto(msg)
    return request_from_fields({**fields, "stream": True} if stream else fields)


def request_from_call(latents, resident_device: torch.device | None = None, **options) -> DecodeRequest:
    """A handle call (a torch tensor or numpy array, the /decode keys as keyword arguments).
    Tensors come to the host, except those already on `resident_device` (the decoding one): a
    compiled graph hands latents over GPU to GPU, and they stay there."""
    unknown = sorted(set(options) - set(REQUEST_KEYS))
    if unknown:
        allowed = sorted(set(REQUEST_KEYS) - {"latents"})
        raise InvalidInput(unknown[0], f"unknown argument{did_you_mean(unknown[0], allowed)} (allowed: {allowed})")
    return DecodeRequest(call_latents(latents, resident_device), **engine_fields(options))


def call_latents(latents, resident_device: torch.device | None = None):
    """A call's latents (numpy or torch) as a torch tensor on the host, or on `resident_device` where
    they are already there; anything else is left for DecodeRequest to refuse, naming `latents`."""
    if isinstance(latents, np.ndarray):
        latents = from_numpy(latents)
    if isinstance(latents, torch.Tensor):
        latents = latents.detach()
        if latents.device != resident_device:
            latents = latents.cpu()
    return latents
