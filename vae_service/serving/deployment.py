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
from vae_service.errors import RequestError
from vae_service.protocol.decode_schema import check_content_type, pack, params_from_map, unpack_body
from vae_service.serving import metrics
from vae_service.serving.decode_service import DecodeService
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
        self.service: DecodeService | None = None

    @property
    def config(self) -> ServiceConfig:
        return self.service.config

    def reconfigure(self, user_config: dict) -> None:
        config = ServiceConfig.model_validate(user_config)
        if self.service is None:
            self.service = DecodeService(config)
        else:
            self.service.reconfigure(config)
        log.info("serving %s", self.service.engine.describe())
        metrics.report_folded_bytes(self.service.engine)

    def release_folded(self) -> int:
        """Handle method: drop the fast path's folded weights now (the next `high` decode rebuilds)."""
        freed = self.service.release_folded() if self.service is not None else 0
        if self.service is not None:
            metrics.report_folded_bytes(self.service.engine)
        return freed

    def __del__(self) -> None:
        # Serve calls this on scale-down, redeploy, delete and shutdown (not on a hard kill)
        freed = self.release_folded()
        log.info("replica shutting down: released %d bytes of folded buffers", freed)

    def check_health(self) -> None:
        if self.service is None:
            raise RuntimeError("no model loaded (reconfigure was never called)")

    @http_app.post("/decode")
    async def decode_http(self, request: Request) -> Response:
        limits = self.config.limits
        check_content_type(request.headers.get("content-type"))
        params = params_from_map(unpack_body(await read_body(request, limits), limits))
        response = await self.service.decode(params)
        metrics.report_folded_bytes(self.service.engine)
        return Response(pack(response), media_type="application/msgpack")

    @http_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", **self.service.engine.describe()}
