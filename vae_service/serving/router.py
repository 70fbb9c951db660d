"""One ingress in front of several decode deployments (one VAE at one precision each), routing by
the request's `model`: the `model` key of a /decode body (read without unpacking the latents, by
the replica's own bounded walk: a body the replica would refuse is refused here, in constant work),
the `model` query parameter of /remote-decode, the gRPC field, or the handle API's argument.
Without a `model`, an application of one model answers with it. It does no tensor work, checks
the bearer token, and answers for a decoder that went away (503 + Retry-After, never a 500) or
is overloaded (its backpressure status + Retry-After).

No `from __future__ import annotations` here: FastAPI must see real `Request` annotations.
"""

from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from vae_service.engine.request.errors import InvalidInput, Overloaded
from vae_service.protocol.errors import ANSWERABLE, Unavailable, wire_error
from vae_service.protocol.msgpack_body import peek_routing
from vae_service.serving.deployment import internal_error
from vae_service.serving.scheduling.admission import Admission
from vae_service.serving.wire import openapi
from vae_service.serving.wire.grpc_servicer import failed, status_message, stream_to
from vae_service.serving.wire.http_routes import error_answer, health_fields, query_lists, respond

router_app = FastAPI(title="vae-service", summary="VAE decoding for diffusion serving (several models)")
router_app.add_exception_handler(Exception, internal_error)
DECODER_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


@serve.deployment(name="VaeRouter")
@serve.ingress(router_app)
class VaeRouter:
    def __init__(
        self,
        decoders: dict[str, DeploymentHandle],
        max_request_bytes: int,
        body_timeout_s: float,
        auth_token_file: str | None = None,
        retry_after_s: float = 1.0,
    ):
        self.decoders = decoders
        self.admission = Admission(max_request_bytes, body_timeout_s, retry_after_s, auth_token_file)

    def _pick(self, model: str | None) -> DeploymentHandle:
        if model is None and len(self.decoders) == 1:
            return next(iter(self.decoders.values()))
        if model not in self.decoders:
            what = "is required" if model is None else f"unknown model {model!r}"
            raise InvalidInput("model", f"{what}; served: {sorted(self.decoders)}")
        return self.decoders[model]

    async def _call(self, call: Awaitable):
        """A decoder's answer; its loss or overload as the error a client can retry on."""
        try:
            return await call
        except DECODER_LOST:
            raise Unavailable("body", "the decoder replica went away; retry", self.admission.retry_after_s) from None
        except BackPressureError as exc:
            raise Overloaded(
                "body", f"decoder overloaded ({exc.message}); retry later", exc.retry_after_s or 1.0
            ) from None

    async def _relay(self, events) -> AsyncIterator:
        """A streaming handle's events; the decoder's loss or overload before the first one as the
        error a client can retry on (later, the stream just ends: the client sees it cut short)."""
        first = await self._call(anext(events))
        yield first
        async for event in events:
            yield event

    @router_app.post("/decode", openapi_extra=openapi.DECODE)
    async def decode_http(self, request: Request) -> Response:
        try:
            body = await self.admission.admit(request)
            model, stream = peek_routing(body, self.admission.max_request_bytes)  # bounded: constant work
            decoder, content_type = self._pick(model), request.headers.get("content-type")
            if stream:
                events = decoder.options(stream=True).decode_body_events.remote(body, content_type)
                return await respond(self._relay(events))
            answer = await self._call(decoder.decode_body.remote(body, content_type))
        except ANSWERABLE as exc:
            return error_answer(exc).response()
        return answer.response()

    @router_app.post("/remote-decode", openapi_extra=openapi.REMOTE_DECODE)
    async def remote_decode_http(self, request: Request) -> Response:
        query = query_lists(request)
        try:
            body = await self.admission.admit(request)
            decoder = self._pick(query.get("model", [None])[-1])
            answer = await self._call(
                decoder.remote_decode_body.remote(
                    body, request.headers.get("content-type"), request.headers.get("accept"), query
                )
            )
        except ANSWERABLE as exc:
            return error_answer(exc).response()
        return answer.response()

    @router_app.get("/health")
    async def health(self, request: Request):
        try:
            self.admission.check(request.headers.get("authorization"))
            models = {name: await self._call(handle.describe.remote()) for name, handle in self.decoders.items()}
        except ANSWERABLE as exc:
            return error_answer(exc).response()
        return health_fields(self.admission, {"models": models})

    async def decode(
        self, latents, quality: str = "lossless", output: str = "uint8", model: str | None = None, **options
    ) -> dict:
        """Handle API of the application: like VaeDecoder.decode, routed by `model`."""
        try:
            return await self._call(
                self._pick(model).decode.remote(latents, quality=quality, output=output, model=model, **options)
            )
        except ANSWERABLE as exc:
            raise wire_error(exc).client_error() from None

    async def Decode(self, request, grpc_context):  # noqa: N802 (the RPC's name)
        try:
            self.admission.check_grpc(grpc_context)
            answer = await self._call(self._pick(request.model or None).grpc_unary.remote(request))
        except ANSWERABLE as exc:
            answer = failed(exc)
        return answer.unary(grpc_context)

    async def DecodeStream(self, request, grpc_context):  # noqa: N802
        async for message in self._stream("DecodeStream", "grpc_item_events", request, grpc_context):
            yield message

    async def DecodeFrames(self, request, grpc_context):  # noqa: N802
        async for message in self._stream("DecodeFrames", "grpc_frame_events", request, grpc_context):
            yield message

    async def _stream(self, rpc: str, method: str, request, grpc_context):
        """A streaming RPC relayed from the decoder's streaming handle method `method`."""
        try:
            self.admission.check_grpc(grpc_context)
            decoder = self._pick(request.model or None).options(stream=True)
            events = getattr(decoder, method).remote(request)
            async for message in stream_to(grpc_context, self._relay(events), rpc):
                yield message
        except ANSWERABLE as exc:
            yield status_message(grpc_context, wire_error(exc), rpc)
