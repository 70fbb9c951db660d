"""The Ray Serve decode deployment: one VAE at one precision, a thin FastAPI ingress around
DecodeService, and handle methods for composition and for a routing ingress.

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
from vae_service.protocol.decode_schema import (
    QUALITIES,
    DecodeParams,
    check_content_type,
    pack,
    params_from_call,
    params_from_map,
    unpack_body,
)
from vae_service.protocol.grpc_codec import params_from_proto, response_to_proto
from vae_service.protocol.grpc_gen import decode_pb2
from vae_service.protocol.hf_remote import parse_remote_decode, remote_decode_reply
from vae_service.protocol.tensor_codec import to_numpy
from vae_service.serving import metrics
from vae_service.serving.decode_service import DecodeOutcome, DecodeService
from vae_service.serving.grpc_api import GrpcResult
from vae_service.serving.http_api import MSGPACK, HttpReply, error_reply, query_dict
from vae_service.serving.http_body import read_body

log = logging.getLogger("ray.serve")  # Serve writes it to the replica's own log file
http_app = FastAPI(title="vae-service", summary="VAE decoding for diffusion serving")
_DRAIN_TIMEOUT_S = 30.0


@http_app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> Response:
    return error_reply(exc).response()


@http_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return JSONResponse({"error": {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}}, status_code=500)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (local testing mode)
        return "local"


class DecoderReplica:
    """A decode replica's behaviour, shared by the plain deployment (handles, gRPC, a routing
    ingress in front) and the one that is its own HTTP ingress."""

    def __init__(self) -> None:
        self.service: DecodeService | None = None

    @property
    def config(self) -> ServiceConfig:
        return self.service.config

    @property
    def model(self) -> str:
        return self.service.engine.spec.name

    def reconfigure(self, user_config: dict) -> None:
        config = ServiceConfig.model_validate(user_config)
        if self.service is None:
            self.service = DecodeService(config, on_batch=self._observe_batch)
        else:
            self.service.reconfigure(config)
        log.info("serving %s", self.service.engine.describe())
        metrics.report_folded_bytes(self.service.engine)

    def _observe_batch(self, stats) -> None:
        metrics.report_batch(self.model, stats)
        metrics.report_folded_bytes(self.service.engine)
        self._report_queue()

    def _report_queue(self) -> None:
        batcher = self.service.batcher
        depth = {tier: batcher.queued_items(lambda key, t=tier: key[0] == t) for tier in QUALITIES}
        metrics.report_queue(self.model, depth)

    def check_health(self) -> None:
        if self.service is None:
            raise RuntimeError("no model loaded (reconfigure was never called)")
        self.service.engine.check_device()

    async def _decode(self, params: DecodeParams) -> DecodeOutcome:
        """Decode validated params through the batcher; rejections are counted by reason."""
        self._report_queue()
        try:
            return await self.service.decode(params)
        except RequestError as exc:
            metrics.report_rejected(self.model, exc.type)
            raise
        except torch.OutOfMemoryError:
            metrics.report_rejected(self.model, "out_of_memory")
            raise Overloaded("latents", "the device ran out of memory for this request; retry later or send "
                             "fewer items", self.config.serving.retry_after_s, status=503) from None

    async def _reply(self, parse, build) -> HttpReply:
        try:
            parsed = parse()
        except RequestError as exc:
            metrics.report_rejected(self.model, exc.type)
            return error_reply(exc)
        try:
            outcome = await self._decode(parsed if isinstance(parsed, DecodeParams) else parsed.params)
        except RequestError as exc:  # counted by _decode
            return error_reply(exc)
        return build(parsed, outcome)

    # ---- bodies (also called through handles by the routing ingress) -------------------------
    async def decode_body(self, body: bytes, content_type: str | None) -> HttpReply:
        limits = self.config.limits

        def parse() -> DecodeParams:
            check_content_type(content_type)
            return params_from_map(unpack_body(body, limits))

        return await self._reply(parse, lambda _, outcome: HttpReply(200, pack(outcome.wire()), MSGPACK))

    async def remote_decode_body(self, body: bytes, content_type: str | None, accept: str | None,
                                 query: dict) -> HttpReply:
        def build(plan, outcome: DecodeOutcome) -> HttpReply:
            data, media_type, headers = remote_decode_reply(plan, outcome.output)
            return HttpReply(200, data, media_type, headers)

        return await self._reply(lambda: parse_remote_decode(body, content_type, accept, query), build)

    def describe(self) -> dict:
        return {"replica": _replica_id(), **self.service.engine.describe(),
                "batching": self.config.batching.model_dump(), "queued_items": self.service.batcher.queued_items()}

    # ---- gRPC (methods named like the RPCs of vae_service.v1.VaeDecoder) ------------------------
    async def grpc_messages(self, request: decode_pb2.DecodeRequest, stream: bool) -> GrpcResult:
        """DecodeResponse messages (one, or one per batch item when streaming), or an error.
        Also what a routing ingress calls through a handle."""
        try:
            params = params_from_proto(request)
        except RequestError as exc:
            metrics.report_rejected(self.model, exc.type)
            return GrpcResult.failed(exc)
        try:
            outcome = await self._decode(params)
        except RequestError as exc:
            return GrpcResult.failed(exc)
        meta = {"model": outcome.model, "quality": outcome.quality, "precision": outcome.precision,
                "request_id": outcome.request_id, "timing": outcome.timing}
        if not stream:
            return GrpcResult([response_to_proto(outcome.output, **meta)])
        items = outcome.output if isinstance(outcome.output, list) else outcome.output.split(1)
        return GrpcResult([response_to_proto([it] if isinstance(it, bytes) else it, **meta, item_index=i)
                           for i, it in enumerate(items)])

    async def Decode(self, request, grpc_context):  # noqa: N802 (the RPC's name)
        return (await self.grpc_messages(request, False)).unary(grpc_context)

    async def DecodeStream(self, request, grpc_context):  # noqa: N802
        for message in (await self.grpc_messages(request, True)).stream(grpc_context):
            yield message

    # ---- composition ---------------------------------------------------------------------------
    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> dict:
        """Handle API: `latents` a torch tensor or numpy array; options are the /decode keys
        (scaling_factor, shift_factor, height, width, request_id, model). Returns the /decode
        response fields with `output` as a numpy array (bf16 as float32) or a list of bytes.
        Bad input raises the same RequestError (with `status` and `field`) HTTP would answer."""
        outcome = await self._decode(params_from_call(latents, quality=quality, output=output, **options))
        out = outcome.output
        if isinstance(out, torch.Tensor):
            out = to_numpy(out)
        return {"output": out, "model": outcome.model, "quality": outcome.quality, "precision": outcome.precision,
                "request_id": outcome.request_id, "timing": outcome.timing}

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


VaeDecoder = serve.deployment(name="VaeDecoder")(DecoderReplica)


@serve.deployment(name="VaeDecoder")
@serve.ingress(http_app)
class VaeDecoderHttp(DecoderReplica):
    """A single-model application: the decode replica is its own HTTP ingress (fewest hops)."""

    @http_app.post("/decode")
    async def decode_http(self, request: Request) -> Response:
        body = await read_body(request, self.config.limits)
        return (await self.decode_body(body, request.headers.get("content-type"))).response()

    @http_app.post("/remote-decode")
    async def remote_decode_http(self, request: Request) -> Response:
        body = await read_body(request, self.config.limits)
        reply = await self.remote_decode_body(body, request.headers.get("content-type"),
                                              request.headers.get("accept"), query_dict(request.query_params))
        return reply.response()

    @http_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", **self.describe()}
