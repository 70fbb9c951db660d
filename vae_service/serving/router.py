"""One ingress in front of several decode deployments (one VAE at one precision each), routing by
the request's `model`: the `model` key of a /decode body (read without unpacking the latents),
the `model` query parameter of /remote-decode, or the handle API's `model` argument. Without a
`model`, an application of one model answers with it.

No `from __future__ import annotations` here: FastAPI must see real `Request` annotations.
"""

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from vae_service.config import Limits
from vae_service.errors import RequestError
from vae_service.protocol.decode_schema import peek_model
from vae_service.serving.grpc_api import GrpcResult
from vae_service.serving.http_api import error_reply, query_dict
from vae_service.serving.http_body import read_body

router_app = FastAPI(title="vae-service", summary="VAE decoding for diffusion serving (several models)")


@router_app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> Response:
    return error_reply(exc).response()


@serve.deployment(name="VaeRouter")
@serve.ingress(router_app)
class VaeRouter:
    def __init__(self, decoders: dict[str, DeploymentHandle], max_request_bytes: int):
        self.decoders = decoders
        self.limits = Limits(max_request_bytes=max_request_bytes)

    def _pick(self, model: str | None) -> DeploymentHandle:
        if model is None and len(self.decoders) == 1:
            return next(iter(self.decoders.values()))
        if model not in self.decoders:
            served = sorted(self.decoders)
            what = "is required" if model is None else f"unknown model {model!r}"
            raise RequestError("model", f"{what}; served: {served}")
        return self.decoders[model]

    @router_app.post("/decode")
    async def decode_http(self, request: Request) -> Response:
        body = await read_body(request, self.limits)
        decoder = self._pick(peek_model(body))
        return (await decoder.decode_body.remote(body, request.headers.get("content-type"))).response()

    @router_app.post("/remote-decode")
    async def remote_decode_http(self, request: Request) -> Response:
        body = await read_body(request, self.limits)
        query = query_dict(request.query_params)
        decoder = self._pick(query.get("model", [None])[-1])
        reply = await decoder.remote_decode_body.remote(body, request.headers.get("content-type"),
                                                        request.headers.get("accept"), query)
        return reply.response()

    @router_app.get("/health")
    async def health(self) -> dict:
        models = {name: await handle.describe.remote() for name, handle in self.decoders.items()}
        return {"status": "ok", "models": models}

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", model: str | None = None,
                     **options) -> dict:
        """Handle API of the application: like VaeDecoder.decode, routed by `model`."""
        return await self._pick(model).decode.remote(latents, quality=quality, output=output, model=model, **options)

    # gRPC: routed by the request's `model` field
    async def _grpc(self, request, stream: bool) -> GrpcResult:
        try:
            decoder = self._pick(request.model or None)
        except RequestError as exc:
            return GrpcResult.failed(exc)
        return await decoder.grpc_messages.remote(request, stream)

    async def Decode(self, request, grpc_context):  # noqa: N802 (the RPC's name)
        return (await self._grpc(request, False)).unary(grpc_context)

    async def DecodeStream(self, request, grpc_context):  # noqa: N802
        for message in (await self._grpc(request, True)).stream(grpc_context):
            yield message
