"""The Serve deployments of a decode replica.

- `VaeDecoder`: handles, gRPC and a routing ingress in front (several models, composition);
- `VaeDecoderHttp`: a single-model application whose replica is its own HTTP ingress (fewest
  hops). Serve refuses two FastAPI ingresses in one application, hence two classes.

No `from __future__ import annotations` here: FastAPI must see real `Request` annotations.
"""

import logging
import uuid

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response
from ray import serve

from vae_service.protocol.errors import Unauthenticated
from vae_service.serving.replica import DecoderReplica
from vae_service.serving.wire import openapi
from vae_service.serving.wire.http_routes import api_docs, decode_http, error_answer, health_fields, remote_decode_http
from vae_service.serving.wire.session_socket import serve_session
from vae_service.serving.wire.watch_routes import watch_page
from vae_service_client.errors import error_json

log = logging.getLogger("ray.serve")
# FastAPI's own /docs, /redoc and /openapi.json would answer without the token: the replica serves
# them itself, behind it (http_routes.api_docs)
http_app = FastAPI(
    title="vae-service",
    summary="VAE decoding for diffusion serving",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)


def internal_error(_: Request, exc: Exception) -> Response:
    """A bug: logged with an id; the client gets the id, never the exception's text."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s", error_id, exc_info=exc)
    return Response(
        error_json("internal", None, f"internal error {error_id} (see the server log)"),
        status_code=500,
        media_type="application/json",
    )


http_app.add_exception_handler(Exception, internal_error)


VaeDecoder = serve.deployment(name="VaeDecoder")(DecoderReplica)


@serve.deployment(name="VaeDecoder")
@serve.ingress(http_app)
class VaeDecoderHttp(DecoderReplica):
    @http_app.post("/decode", openapi_extra=openapi.DECODE)
    async def decode_http(self, request: Request) -> Response:
        return await decode_http(self.service, self.admission, request)

    @http_app.post("/remote-decode", openapi_extra=openapi.REMOTE_DECODE)
    async def remote_decode_http(self, request: Request) -> Response:
        return (await remote_decode_http(self.service, self.admission, request)).response()

    @http_app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(self, request: Request) -> Response:
        return api_docs(self.service, self.admission, request, http_app, "openapi")

    @http_app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        return api_docs(self.service, self.admission, request, http_app, "swagger")

    @http_app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        return api_docs(self.service, self.admission, request, http_app, "redoc")

    @http_app.websocket("/sessions")
    async def sessions(self, websocket: WebSocket) -> None:
        await serve_session(self.service, self.admission, websocket)

    @http_app.get("/watch/{watch_id}", include_in_schema=False)
    async def watch_page(self, watch_id: str) -> Response:
        return watch_page()

    @http_app.websocket("/watch/{watch_id}/stream")
    async def watch_stream(self, websocket: WebSocket, watch_id: str) -> None:
        await self.watch_routes.stream(websocket, watch_id)

    @http_app.post("/watch/{watch_id}/whep", include_in_schema=False)
    async def whep_offer(self, request: Request, watch_id: str) -> Response:
        return await self.watch_routes.whep_offer(request, watch_id)

    @http_app.delete("/watch/{watch_id}/whep/{resource}", include_in_schema=False)
    async def whep_delete(self, request: Request, watch_id: str, resource: str) -> Response:
        return await self.watch_routes.whep_delete(request, watch_id, resource)

    @http_app.options("/watch/{watch_id}/whep", include_in_schema=False)
    @http_app.options("/watch/{watch_id}/whep/{resource}", include_in_schema=False)
    async def whep_preflight(self, request: Request) -> Response:
        return self.watch_routes.preflight(request)

    @http_app.get("/health")
    async def health(self, request: Request):
        try:
            self.admission.check(request.headers.get("authorization"))
        except Unauthenticated as exc:
            return error_answer(self.service.rejected(exc)).response()
        return health_fields(self.admission, self.describe())
