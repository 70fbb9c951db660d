"""gRPC messages <-> the same DecodeParams and response fields as the msgpack contract, so the
gRPC path shares every validation rule with HTTP."""

from __future__ import annotations

import grpc
import torch

from vae_service.errors import RequestError
from vae_service.protocol.decode_schema import UNSET, DecodeParams, params_from_map
from vae_service.protocol.grpc_gen import decode_pb2
from vae_service.protocol.tensor_codec import encode_tensor

# error type -> gRPC status
STATUS = {
    "invalid_request": grpc.StatusCode.INVALID_ARGUMENT,
    "unsupported_media_type": grpc.StatusCode.INVALID_ARGUMENT,
    "decode_failed": grpc.StatusCode.INVALID_ARGUMENT,
    "payload_too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
}


def params_from_proto(req: decode_pb2.DecodeRequest) -> DecodeParams:
    if not req.HasField("latents"):
        raise RequestError("latents", "is required")
    fields = {
        "latents": {"dtype": req.latents.dtype, "shape": list(req.latents.shape), "data": req.latents.data},
        "quality": req.quality or "lossless",
        "output": req.output or "uint8",
    }
    if req.latents_scaled:
        fields["scaling_factor"] = fields["shift_factor"] = None
    if req.HasField("scaling_factor"):
        fields["scaling_factor"] = req.scaling_factor
    if req.HasField("shift_factor"):
        fields["shift_factor"] = req.shift_factor
    for key in ("height", "width"):
        if getattr(req, key):
            fields[key] = getattr(req, key)
    for key in ("request_id", "model"):
        if getattr(req, key):
            fields[key] = getattr(req, key)
    return params_from_map(fields)


def request_to_proto(latents, quality: str = "lossless", output: str = "uint8", *, scaling_factor=UNSET,
                     shift_factor=UNSET, height: int | None = None, width: int | None = None,
                     request_id: str | None = None, model: str | None = None) -> decode_pb2.DecodeRequest:
    t = encode_tensor(latents)
    req = decode_pb2.DecodeRequest(latents=decode_pb2.Tensor(**t), quality=quality, output=output,
                                   height=height or 0, width=width or 0, request_id=request_id or "", model=model or "")
    if scaling_factor is None:
        req.latents_scaled = True
    elif scaling_factor is not UNSET:
        req.scaling_factor = scaling_factor
    if shift_factor not in (None, UNSET):
        req.shift_factor = shift_factor
    return req


def response_to_proto(output: torch.Tensor | list[bytes], *, model: str, quality: str, precision: str,
                      request_id: str | None, timing: dict, item_index: int = 0) -> decode_pb2.DecodeResponse:
    resp = decode_pb2.DecodeResponse(model=model, quality=quality, precision=precision, request_id=request_id or "",
                                     timing=decode_pb2.Timing(**timing), item_index=item_index)
    if isinstance(output, list):
        resp.files.extend(output)
    else:
        resp.tensor.CopyFrom(decode_pb2.Tensor(**encode_tensor(output)))
    return resp
