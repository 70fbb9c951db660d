"""HTTP clients (sync and async) for `POST /decode` (whole answers, frame streams, streamed mp4 and webm),
`GET /health` and decode sessions (WebSocket `/sessions`: sessions.py), with retries on 429/503
(retries.py), and transport failures as typed errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import httpx

from vae_service_client.errors import (
    DecodeTimeout,
    ServiceUnreachable,
    Unavailable,
    VaeServiceError,
    connection_error,
    error_from_http,
)
from vae_service_client.frames import AsyncFrameStream, FrameStream, MessageReader, StreamSummary
from vae_service_client.messages import MSGPACK, DecodeResponse, pack, request_map
from vae_service_client.mp4 import write_chunks, write_chunks_async
from vae_service_client.retries import with_retries, with_retries_async
from vae_service_client.sessions import AsyncDecodeSession, SessionLink, SessionOpener, ws_url


def _response(r: httpx.Response) -> DecodeResponse:
    import msgpack

    if r.status_code != 200:
        raise error_from_http(r.status_code, r.headers, r.content)
    return DecodeResponse.from_map(msgpack.unpackb(r.content, raw=False))


def _health(r: httpx.Response) -> dict:
    if r.status_code != 200:
        raise error_from_http(r.status_code, r.headers, r.content)
    return r.json()


def _transport_error(exc: httpx.TransportError, request: httpx.Request, timeout: float) -> VaeServiceError:
    """httpx's failure of the connection as a typed error whose text is one line naming the
    request and the cause (httpx's own reaches a caller as a long traceback)."""
    where, text = f"{request.method} {request.url}", str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return connection_error(ServiceUnreachable, "unreachable", where, f"timed out connecting (timeout={timeout} s)")
    if isinstance(exc, httpx.TimeoutException):  # read, write or pool: the connection was there
        what = {httpx.WriteTimeout: "nothing sent", httpx.PoolTimeout: "no free connection"}.get(type(exc))
        return connection_error(
            DecodeTimeout, "timeout", where, f"{what or 'nothing received'} within timeout={timeout} s"
        )
    if isinstance(exc, httpx.ConnectError):
        cause = "connection refused (nothing listening)" if _refused(exc) else f"cannot connect ({text})"
        return connection_error(ServiceUnreachable, "unreachable", where, cause)
    if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError):  # reset, or closed early
        return connection_error(
            Unavailable, "unavailable", where, f"the connection closed before the answer was complete ({text})"
        )
    return connection_error(ServiceUnreachable, "unreachable", where, text)  # proxy, unsupported scheme


def _refused(exc: BaseException | None) -> bool:
    # the OS error sits a few causes down (anyio wraps it in "All connection attempts failed")
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def _typed_transport_errors(request: httpx.Request, timeout: float) -> Iterator[None]:
    try:
        yield
    except httpx.TransportError as exc:
        raise _transport_error(exc, request, timeout) from None


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class _Base(SessionOpener):
    """`retries`: extra attempts on 429/503 and on a connection closed before the answer was
    complete (backoff doubling from `backoff_s`, at least the server's Retry-After: retries.py);
    `timeout`: seconds per attempt (without a byte of the answer); `token`: the service's bearer
    token, when it requires one."""

    _client_class: type = httpx.Client

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        timeout: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
    ):
        self._http = self._client_class(base_url=base_url, timeout=timeout, headers=_headers(token))
        self.timeout, self.retries, self.backoff_s = timeout, retries, backoff_s
        self._token = token

    def _session_link(self) -> SessionLink:
        """`ws(s)://` beside base_url, the token on its handshake, this client's timeout and retries;
        base_url is what a watched session's url is relative to."""
        base = str(self._http.base_url)
        return SessionLink(ws_url(base), _headers(self._token), self.timeout, self.retries, self.backoff_s, base)

    def _decode_request(self, body: bytes) -> httpx.Request:
        return self._http.build_request("POST", "/decode", content=body, headers={"content-type": MSGPACK})

    def _transport(self, request: httpx.Request):
        """Around everything that sends `request` or reads its answer: transport failures typed."""
        return _typed_transport_errors(request, self.timeout)


class VaeClient(_Base):
    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        """latents: numpy array or torch tensor. options: scaling_factor, shift_factor (None = already
        scaled), height, width (packed latents), request_id, model, decode_timestep (LTX), tiling,
        sink and key, priority (the scheduler's class: realtime | interactive | bulk; None: the
        deployment's default). Every decode and stream call takes the same options."""
        body = pack(request_map(latents, quality, output, **options))

        def attempt() -> DecodeResponse:
            request = self._decode_request(body)
            with self._transport(request):
                return _response(self._http.send(request))

        return with_retries(attempt, self.retries, self.backoff_s)

    def decode_frames(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> FrameStream:
        """Video frames as they are decoded: iterate the stream for FrameChunks (`collect()` joins
        them into the non-streamed output, but for the frames an item sent before it fell back to
        fp32: `summary.fallback_from_frame`); its `summary` holds the rest once it ended. Retries
        (retries.py) until the first frame; a connection closed after it raises Unavailable. The
        request is sent when iteration starts."""
        body = pack(request_map(latents, quality, output, stream=True, **options))

        def messages():
            response, reader = self._open_stream(body), MessageReader()
            try:
                with self._transport(response.request):  # cut after frames went out: not retried
                    for data in response.iter_bytes():
                        yield from reader.feed(data)
            finally:
                response.close()
            reader.close()

        return FrameStream(messages())

    def decode_mp4(self, latents, target: str | Path | BinaryIO, quality: str = "lossless", **options) -> StreamSummary:
        """decode_video with output "mp4"."""
        return self.decode_video(latents, target, quality, output="mp4", **options)

    def decode_video(
        self, latents, target: str | Path | BinaryIO, quality: str = "lossless", output: str = "mp4", **options
    ) -> StreamSummary:
        """A video as a fragmented MP4 (`output` "mp4") or a WebM ("webm") streamed into `target` (a
        path or a binary file) while it decodes, each fragment written and flushed as it arrives (a
        player can follow the file); returns the summary. The file is the whole `mp4` (`webm`) answer
        of the same request (of the frames sent, where the item fell back to fp32 after some:
        `summary.fallback_from_frame`)."""
        response = self._open_stream(pack(request_map(latents, quality, output, stream=True, **options)))
        try:
            with self._transport(response.request):
                return StreamSummary(write_chunks(response.iter_bytes(), target, output))
        finally:
            response.close()

    def _open_stream(self, body: bytes) -> httpx.Response:
        """A streamed answer's response once it opened (200); retried (retries.py) before that."""

        def attempt() -> httpx.Response:
            request = self._decode_request(body)
            with self._transport(request):
                response = self._http.send(request, stream=True)
                if response.status_code != 200:
                    response.read()
                    response.close()
                    raise error_from_http(response.status_code, response.headers, response.content)
            return response

        return with_retries(attempt, self.retries, self.backoff_s)

    def health(self) -> dict:
        request = self._http.build_request("GET", "/health")
        with self._transport(request):
            return _health(self._http.send(request))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VaeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncVaeClient(_Base):
    _client_class = httpx.AsyncClient
    _session_class = AsyncDecodeSession

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        body = pack(request_map(latents, quality, output, **options))

        async def attempt() -> DecodeResponse:
            request = self._decode_request(body)
            with self._transport(request):
                return _response(await self._http.send(request))

        return await with_retries_async(attempt, self.retries, self.backoff_s)

    def decode_frames(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> AsyncFrameStream:
        """Like VaeClient.decode_frames; iterate with `async for`."""
        body = pack(request_map(latents, quality, output, stream=True, **options))

        async def messages():
            response, reader = await self._open_stream(body), MessageReader()
            try:
                with self._transport(response.request):  # cut after frames went out: not retried
                    async for data in response.aiter_bytes():
                        for message in reader.feed(data):
                            yield message
            finally:
                await response.aclose()
            reader.close()

        return AsyncFrameStream(messages())

    async def decode_mp4(
        self, latents, target: str | Path | BinaryIO, quality: str = "lossless", **options
    ) -> StreamSummary:
        """Like VaeClient.decode_mp4."""
        return await self.decode_video(latents, target, quality, output="mp4", **options)

    async def decode_video(
        self, latents, target: str | Path | BinaryIO, quality: str = "lossless", output: str = "mp4", **options
    ) -> StreamSummary:
        """Like VaeClient.decode_video."""
        response = await self._open_stream(pack(request_map(latents, quality, output, stream=True, **options)))
        try:
            with self._transport(response.request):
                return StreamSummary(await write_chunks_async(response.aiter_bytes(), target, output))
        finally:
            await response.aclose()

    async def _open_stream(self, body: bytes) -> httpx.Response:
        async def attempt() -> httpx.Response:
            request = self._decode_request(body)
            with self._transport(request):
                response = await self._http.send(request, stream=True)
                if response.status_code != 200:
                    await response.aread()
                    await response.aclose()
                    raise error_from_http(response.status_code, response.headers, response.content)
            return response

        return await with_retries_async(attempt, self.retries, self.backoff_s)

    async def health(self) -> dict:
        request = self._http.build_request("GET", "/health")
        with self._transport(request):
            return _health(await self._http.send(request))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncVaeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
