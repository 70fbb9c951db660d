"""gRPC `vae_service.v1.VaeDecoder`: a DecodeRequest message -> DecodeRequest, a DecodeResult ->
DecodeResponse messages (one, or one per batch item for DecodeStream)."""

from __future__ import annotations

from vae_service.engine.request import DecodeRequest
from vae_service.engine.result import DecodeResult
from vae_service.protocol.msgpack_decode import request_from_fields, response_of
from vae_service_client.messages import request_fields_from_proto


def request_from_proto(msg) -> DecodeRequest:
    return request_from_fields(request_fields_from_proto(msg))


def response_protos(result: DecodeResult, stream: bool) -> list:
    if not stream:
        return [response_of(result).to_proto()]
    out = result.output
    items = [[f] for f in out] if isinstance(out, list) else out.split(1)
    return [response_of(result, item, i).to_proto() for i, item in enumerate(items)]
