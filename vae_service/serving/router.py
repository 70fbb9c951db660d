"""One ingress in front of several decode deployments (one VAE at one precision each), routing by
the request's `model`: the `model` key of a /decode body (read without unpacking the latents),
the `model` query parameter of /remote-decode, the gRPC field, or the handle API's argument.
Without a `model`, an application of one model answers with it. It does no tensor work.

No `from __future__ import annotations` here: FastAPI must see real `Request` annotations.
"""

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from vae_service.engine.errors import InvalidInput
from vae_service.protocol.errors import ANSWERABLE, wire_error
from vae_service.protocol.msgpack_decode import peek_model
from vae_service.serving.deployment import internal_error
from vae_service.serving.grpc_servicer import GrpcAnswer, failed
from vae_service.serving.http_routes import error_answer, query_lists, read_body

router_app = FastAPI(title="vae-service", summary="VAE decoding for diffusion serving (several models)")
router_app.add_exception_handler(Exception, internal_error)


@serve.deployment(name="VaeRouter")
@serve.ingress(router_app)
class VaeRouter:
    def __init__(self, decoders: dict[str, DeploymentHandle], max_request_bytes: int):
        self.decoders = decoders
        self.max_request_bytes = max_request_bytes

    def _pick(self, model: str | None) -> DeploymentHandle:
        if model is None and len(self.decoders) == 1:
            return next(iter(self.decoders.values()))
        if model not in self.decoders:
            what = "is required" if model is None else f"unknown model {model!r}"
            raise InvalidInput("model", f"{what}; served: {sorted(self.decoders)}")
        return self.decoders[model]

    @router_app.post("/decode")
    async def decode_http(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_request_bytes)
            decoder = self._pick(peek_model(body))
        except ANSWERABLE as exc:
            return error_answer(exc).response()
        return (await decoder.decode_body.remote(body, request.headers.get("content-type"))).response()

    @router_app.post("/remote-decode")
    async def remote_decode_http(self, request: Request) -> Response:
        query = query_lists(request)
        try:
            body = await read_body(request, self.max_request_bytes)
            decoder = self._pick(query.get("model", [None])[-1])
        except ANSWERABLE as exc:
            return error_answer(exc).response()
        answer = await decoder.remote_decode_body.remote(
            body, request.headers.get("content-type"), request.headers.get("accept"), query
        )
        return answer.response()

    @router_app.get("/health")
    async def health(self) -> dict:
        models = {name: await handle.describe.remote() for name, handle in self.decoders.items()}
        return {"status": "ok", "models": models}

    async def decode(
        self, latents, quality: str = "lossless", output: str = "uint8", model: str | None = None, **options
    ) -> dict:
        """Handle API of the application: like VaeDecoder.decode, routed by `model`."""
        try:
            decoder = self._pick(model)
        except InvalidInput as exc:
            raise wire_error(exc).client_error() from None
        return await decoder.decode.remote(latents, quality=quality, output=output, model=model, **options)

    async def _grpc(self, request, stream: bool) -> GrpcAnswer:
        try:
            decoder = self._pick(request.model or None)
        except InvalidInput as exc:
            return failed(exc)
        return await decoder.grpc_messages.remote(request, stream)

    async def Decode(self, request, grpc_context):  # noqa: N802 (the RPC's name)
        return (await self._grpc(request, False)).unary(grpc_context)

    async def DecodeStream(self, request, grpc_context):  # noqa: N802
        for message in (await self._grpc(request, True)).stream(grpc_context):
            yield message
