"""The Ray Serve decode deployment: a thin FastAPI ingress around DecodeService.

No `from __future__ import annotations` here: FastAPI must see real `Request` annotations.

Config arrives as `user_config` (a ServiceConfig dict) through `reconfigure`, so `serve deploy`
with a changed config updates replicas in place.
"""


import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine
from vae_service.errors import RequestError
from vae_service.protocol.decode_schema import check_content_type, pack, params_from_map, unpack_body
from vae_service.serving.decode_service import DecodeService, needs_new_engine
from vae_service.serving.http_body import read_body

log = logging.getLogger("vae_service")
http_app = FastAPI(title="vae-service", summary="VAE decoding for diffusion serving")


@http_app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.status)


@http_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return JSONResponse({"error": {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}}, status_code=500)


@serve.deployment(name="VaeDecoder")
@serve.ingress(http_app)
class VaeDecoder:
    def __init__(self) -> None:
        self.config: ServiceConfig | None = None
        self.service: DecodeService | None = None

    def reconfigure(self, user_config: dict) -> None:
        config = ServiceConfig.model_validate(user_config)
        if self.config is None or needs_new_engine(self.config, config):
            engine = DecodeEngine(config)
            self.service = DecodeService(engine)
            log.info("serving %s", engine.describe())
        else:
            self.service.engine.config = config
        self.config = config

    def check_health(self) -> None:
        if self.service is None:
            raise RuntimeError("no model loaded (reconfigure was never called)")

    @http_app.post("/decode")
    async def decode_http(self, request: Request) -> Response:
        limits = self.config.limits
        check_content_type(request.headers.get("content-type"))
        params = params_from_map(unpack_body(await read_body(request, limits), limits))
        return Response(pack(await self.service.decode(params)), media_type="application/msgpack")

    @http_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", **self.service.engine.describe()}
