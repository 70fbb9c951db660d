"""gRPC clients (sync and async) for vae_service.v1.VaeDecoder: unary Decode and streaming
DecodeStream, with the HTTP client's typed errors and retries."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

import grpc
import numpy as np

from vae_service.protocol.grpc_codec import request_to_proto
from vae_service.protocol.grpc_gen import decode_pb2, decode_pb2_grpc
from vae_service.protocol.tensor_codec import decode_tensor, to_numpy
from vae_service_client.wire import DecodeResponse, VaeServiceError, error_class, with_retries, with_retries_async

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


_TYPE_STATUS = {"invalid_request": 400, "unsupported_media_type": 415, "decode_failed": 422,
                "payload_too_large": 413, "overloaded": 429, "timeout": 504}


def _error(exc: grpc.RpcError) -> VaeServiceError:
    """The server's error type travels in the `error-type` trailer; without it (Serve's own
    backpressure, transport errors) the status code decides."""
    trailers = dict(exc.trailing_metadata() or ())
    error_type = trailers.get("error-type")
    status = _TYPE_STATUS.get(error_type) or _HTTP_STATUS.get(exc.code(), 500)
    details = exc.details() or ""
    field = details.split(":", 1)[0] if ":" in details else None
    return error_class(status)(status, error_type or exc.code().name.lower(), details, field)


def _response(msg: decode_pb2.DecodeResponse) -> DecodeResponse:
    if msg.HasField("tensor"):
        t = decode_tensor({"dtype": msg.tensor.dtype, "shape": list(msg.tensor.shape), "data": msg.tensor.data}, "output")
        output: np.ndarray | list[bytes] = to_numpy(t)
    else:
        output = list(msg.files)
    timing = {"queue_ms": msg.timing.queue_ms, "decode_ms": msg.timing.decode_ms, "batch_size": msg.timing.batch_size}
    return DecodeResponse(output, msg.model, msg.quality, msg.precision, msg.request_id or None, timing)


_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 512 * 2**20), ("grpc.max_send_message_length", 512 * 2**20)]


class VaeGrpcClient:
    """`application`: the Serve application to reach (gRPC routes by this metadata)."""

    def __init__(self, target: str = "127.0.0.1:9000", application: str | None = None, timeout: float = 120.0,
                 retries: int = 3, backoff_s: float = 0.5):
        self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._stub = decode_pb2_grpc.VaeDecoderStub(self._channel)
        self._metadata = (("application", application),) if application else ()
        self.timeout, self.retries, self.backoff_s = timeout, retries, backoff_s

    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        request = request_to_proto(latents, quality, output, **options)

        def attempt() -> DecodeResponse:
            try:
                return _response(self._stub.Decode(request, timeout=self.timeout, metadata=self._metadata))
            except grpc.RpcError as exc:
                raise _error(exc) from None

        return with_retries(attempt, self.retries, self.backoff_s)

    def decode_stream(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> Iterator[DecodeResponse]:
        """One DecodeResponse per batch item, in order."""
        request = request_to_proto(latents, quality, output, **options)
        try:
            for msg in self._stub.DecodeStream(request, timeout=self.timeout, metadata=self._metadata):
                yield _response(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "VaeGrpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncVaeGrpcClient:
    def __init__(self, target: str = "127.0.0.1:9000", application: str | None = None, timeout: float = 120.0,
                 retries: int = 3, backoff_s: float = 0.5):
        self._channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._stub = decode_pb2_grpc.VaeDecoderStub(self._channel)
        self._metadata = (("application", application),) if application else ()
        self.timeout, self.retries, self.backoff_s = timeout, retries, backoff_s

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        request = request_to_proto(latents, quality, output, **options)

        async def attempt() -> DecodeResponse:
            try:
                return _response(await self._stub.Decode(request, timeout=self.timeout, metadata=self._metadata))
            except grpc.RpcError as exc:
                raise _error(exc) from None

        return await with_retries_async(attempt, self.retries, self.backoff_s)

    async def decode_stream(self, latents, quality: str = "lossless", output: str = "uint8",
                            **options) -> AsyncIterator[DecodeResponse]:
        request = request_to_proto(latents, quality, output, **options)
        try:
            async for msg in self._stub.DecodeStream(request, timeout=self.timeout, metadata=self._metadata):
                yield _response(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def aclose(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncVaeGrpcClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
