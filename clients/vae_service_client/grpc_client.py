"""gRPC clients (sync and async) for vae_service.v1.VaeDecoder: unary Decode, DecodeStream (one
answer per batch item), DecodeFrames (video frames as decoded) and DecodeSession (a video decoded
chunk by chunk: `session`, as the HTTP client's), with the HTTP client's typed errors and retries
(unary calls and a session's open)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import BinaryIO

import grpc

from vae_service_client.errors import (
    TYPE_TRAILER,
    ServiceUnreachable,
    VaeServiceError,
    connection_error,
    error_from_grpc,
)
from vae_service_client.frames import AsyncFrameStream, FrameStream, StreamSummary, message_of_proto
from vae_service_client.grpc_gen import decode_pb2_grpc
from vae_service_client.grpc_sessions import GrpcSessionLink
from vae_service_client.messages import DecodeResponse, request_proto
from vae_service_client.mp4 import write_fragments, write_fragments_async
from vae_service_client.retries import with_retries, with_retries_async
from vae_service_client.sessions import AsyncDecodeSession, SessionOpener

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 512 * 2**20), ("grpc.max_send_message_length", 512 * 2**20)]


# grpc reports every failure of the connection as UNAVAILABLE; only its text tells one that never
# connected (nothing sent: a wrong target or a stopped service, not retried) from a call cut off
_CONNECT_FAILED = re.compile(r"failed to connect|errors resolving|DNS resolution failed", re.IGNORECASE)


def _typed_error(exc: grpc.RpcError, target: str, timeout: float) -> VaeServiceError:
    code, details, trailers = exc.code().name, exc.details() or "", exc.trailing_metadata()
    if TYPE_TRAILER in dict(trailers or ()):  # the service's own answer
        return error_from_grpc(code, details, trailers)
    # grpc's own status (a transport failure, a deadline) or Serve's proxy's: say where and which timeout
    if code == "UNAVAILABLE" and _CONNECT_FAILED.search(details):
        refused = "connection refused" in details.lower()
        cause = "connection refused (nothing listening)" if refused else f"cannot connect ({details})"
        return connection_error(ServiceUnreachable, "unreachable", target, cause, via="grpc", grpc_code=code)
    if code == "DEADLINE_EXCEEDED":
        details = f"{details} (timeout={timeout} s)"
    return error_from_grpc(code, " ".join(f"{target}: {details}".split()), trailers)


class _Base(SessionOpener):
    """`application`: the Serve application to reach (Serve's gRPC proxy routes by this metadata);
    `token`: the service's bearer token, when it requires one; `http_base_url`: the same service's
    HTTP base URL (its route prefix included), against which a watched session's `watch.url` is made
    absolute (None: it stays relative, a path under that base)."""

    _open_channel = staticmethod(grpc.insecure_channel)

    def __init__(
        self,
        target: str = "127.0.0.1:9000",
        application: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
        http_base_url: str | None = None,
    ):
        self._channel = self._open_channel(target, options=_CHANNEL_OPTIONS)
        self._stub = decode_pb2_grpc.VaeDecoderStub(self._channel)
        metadata = [("application", application)] if application else []
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        self._metadata = tuple(metadata)
        self.target, self.timeout, self.retries, self.backoff_s = target, timeout, retries, backoff_s
        self.http_base_url = http_base_url

    def _error(self, exc: grpc.RpcError) -> VaeServiceError:
        return _typed_error(exc, self.target, self.timeout)

    def _session_link(self) -> GrpcSessionLink:
        """A DecodeSession call on this channel, with its metadata, timeout and retries."""
        return GrpcSessionLink(
            self.target,
            {},
            self.timeout,
            self.retries,
            self.backoff_s,
            http_base=self.http_base_url,
            stub=self._stub,
            metadata=self._metadata,
            typed_error=self._error,
        )


def carries_something(msg) -> bool:
    """False for the empty message (DecodeResponse or FrameMessage) that carries a failed stream's
    status (Serve's gRPC proxy relays a stream's status only along with a message); the status
    itself raises on the next read. Every other message sets a field."""
    return msg.ByteSize() > 0


class VaeGrpcClient(_Base):
    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        request = request_proto(latents, quality, output, **options)

        def attempt() -> DecodeResponse:
            try:
                return DecodeResponse.from_proto(
                    self._stub.Decode(request, timeout=self.timeout, metadata=self._metadata)
                )
            except grpc.RpcError as exc:
                raise self._error(exc) from None

        return with_retries(attempt, self.retries, self.backoff_s)

    def decode_stream(
        self, latents, quality: str = "lossless", output: str = "uint8", **options
    ) -> Iterator[DecodeResponse]:
        """One DecodeResponse per batch item, in order, once the batch is decoded (every model; a
        video model's item carries all its frames). Frames as they decode: decode_frames."""
        request = request_proto(latents, quality, output, **options)
        try:
            for msg in self._stub.DecodeStream(request, timeout=self.timeout, metadata=self._metadata):
                if carries_something(msg):
                    yield DecodeResponse.from_proto(msg)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def decode_frames(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> FrameStream:
        """Video frames as they are decoded (DecodeFrames; video models, uint8/float output; mp4 or
        webm: Mp4Fragments, see decode_video)."""
        request = request_proto(latents, quality, output, **options)

        def messages():
            try:
                for msg in self._stub.DecodeFrames(request, timeout=self.timeout, metadata=self._metadata):
                    if (message := message_of_proto(msg)) is not None:
                        yield message
            except grpc.RpcError as exc:
                raise self._error(exc) from None

        return FrameStream(messages())

    def decode_mp4(self, latents, target: str | Path | BinaryIO, quality: str = "lossless", **options) -> StreamSummary:
        """decode_video with output "mp4"."""
        return self.decode_video(latents, target, quality, output="mp4", **options)

    def decode_video(
        self, latents, target: str | Path | BinaryIO, quality: str = "lossless", output: str = "mp4", **options
    ) -> StreamSummary:
        """A video as a fragmented MP4 (`output` "mp4") or a WebM ("webm") streamed into `target` (a
        path or a binary file) while it decodes (DecodeFrames); returns the summary (see
        VaeClient.decode_video)."""
        stream = self.decode_frames(latents, quality, output, **options)
        write_fragments(stream, target)
        return stream.summary

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> VaeGrpcClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncVaeGrpcClient(_Base):
    _open_channel = staticmethod(grpc.aio.insecure_channel)
    _session_class = AsyncDecodeSession

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        request = request_proto(latents, quality, output, **options)

        async def attempt() -> DecodeResponse:
            try:
                return DecodeResponse.from_proto(
                    await self._stub.Decode(request, timeout=self.timeout, metadata=self._metadata)
                )
            except grpc.RpcError as exc:
                raise self._error(exc) from None

        return await with_retries_async(attempt, self.retries, self.backoff_s)

    async def decode_stream(
        self, latents, quality: str = "lossless", output: str = "uint8", **options
    ) -> AsyncIterator[DecodeResponse]:
        request = request_proto(latents, quality, output, **options)
        try:
            async for msg in self._stub.DecodeStream(request, timeout=self.timeout, metadata=self._metadata):
                if carries_something(msg):
                    yield DecodeResponse.from_proto(msg)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def decode_frames(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> AsyncFrameStream:
        request = request_proto(latents, quality, output, **options)

        async def messages():
            try:
                async for msg in self._stub.DecodeFrames(request, timeout=self.timeout, metadata=self._metadata):
                    if (message := message_of_proto(msg)) is not None:
                        yield message
            except grpc.RpcError as exc:
                raise self._error(exc) from None

        return AsyncFrameStream(messages())

    async def decode_mp4(
        self, latents, target: str | Path | BinaryIO, quality: str = "lossless", **options
    ) -> StreamSummary:
        return await self.decode_video(latents, target, quality, output="mp4", **options)

    async def decode_video(
        self, latents, target: str | Path | BinaryIO, quality: str = "lossless", output: str = "mp4", **options
    ) -> StreamSummary:
        stream = self.decode_frames(latents, quality, output, **options)
        await write_fragments_async(stream, target)
        return stream.summary

    async def aclose(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncVaeGrpcClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
