"""The Ray Serve decode deployment: a thin FastAPI ingress around DecodeService.

No `from __future__ import annotations` here: FastAPI must see real `Request` annotations.

Config arrives as `user_config` (a ServiceConfig dict) through `reconfigure`, so `serve deploy`
with a changed config updates replicas in place: limits and batching live, model or precision
by reloading the weights.
"""

import logging

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from vae_service.config import ServiceConfig
from vae_service.errors import Overloaded, RequestError
from vae_service.protocol.decode_schema import QUALITIES, check_content_type, pack, params_from_map, unpack_body
from vae_service.serving import metrics
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.http_body import read_body

log = logging.getLogger("ray.serve")  # Serve writes it to the replica's own log file
http_app = FastAPI(title="vae-service", summary="VAE decoding for diffusion serving")
_DRAIN_TIMEOUT_S = 30.0


def error_response(exc: RequestError) -> JSONResponse:
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


@http_app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)


@http_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return JSONResponse({"error": {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}}, status_code=500)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (local testing mode)
        return "local"


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
            self.service = DecodeService(config, on_batch=self._observe_batch)
        else:
            self.service.reconfigure(config)
        log.info("serving %s", self.service.engine.describe())
        metrics.report_folded_bytes(self.service.engine)

    def _observe_batch(self, stats) -> None:
        engine = self.service.engine
        metrics.report_batch(engine.spec.name, stats)
        metrics.report_folded_bytes(engine)
        self._report_queue()

    def _report_queue(self) -> None:
        batcher = self.service.batcher
        depth = {tier: batcher.queued_items(lambda key, t=tier: key[0] == t) for tier in QUALITIES}
        metrics.report_queue(self.service.engine.spec.name, depth)

    def check_health(self) -> None:
        if self.service is None:
            raise RuntimeError("no model loaded (reconfigure was never called)")
        self.service.engine.check_device()

    async def decode_params(self, params) -> dict:
        """Decode validated params through the batcher, counting rejections by reason."""
        try:
            response = await self.service.decode(params)
        except RequestError as exc:
            metrics.report_rejected(self.service.engine.spec.name, exc.type)
            raise
        except torch.OutOfMemoryError:
            metrics.report_rejected(self.service.engine.spec.name, "out_of_memory")
            raise Overloaded("latents", "the device ran out of memory for this request; retry later or send "
                             "fewer items", self.config.serving.retry_after_s, status=503) from None
        return response

    @http_app.post("/decode")
    async def decode_http(self, request: Request) -> Response:
        limits = self.config.limits
        try:
            check_content_type(request.headers.get("content-type"))
            params = params_from_map(unpack_body(await read_body(request, limits), limits))
        except RequestError as exc:
            metrics.report_rejected(self.service.engine.spec.name, exc.type)
            raise
        self._report_queue()
        return Response(pack(await self.decode_params(params)), media_type="application/msgpack")

    @http_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "replica": _replica_id(), **self.service.engine.describe(),
                "batching": self.config.batching.model_dump(), "queued_items": self.service.batcher.queued_items()}

    def release_folded(self) -> int:
        """Handle method: drop the fast path's folded weights now (the next `high` decode rebuilds)."""
        if self.service is None:
            return 0
        freed = self.service.release_folded()
        metrics.report_folded_bytes(self.service.engine)
        return freed

    async def __del__(self) -> None:
        # Serve calls this on scale-down, redeploy, delete and shutdown (not on a hard kill):
        # let queued and running batches finish, then give the folded buffers back.
        if self.service is None:
            return
        drained = await self.service.batcher.drain(_DRAIN_TIMEOUT_S)
        freed = self.release_folded()
        log.info("replica %s shutting down: drained=%s, released %d bytes of folded buffers",
                 _replica_id(), drained, freed)
