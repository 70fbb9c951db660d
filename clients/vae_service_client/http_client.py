"""HTTP clients (sync and async) for `POST /decode` and `GET /health`, with retries on 429/503."""

from __future__ import annotations

import httpx

from vae_service_client.errors import error_from_http
from vae_service_client.messages import MSGPACK, DecodeResponse, pack, request_map
from vae_service_client.retries import with_retries, with_retries_async


def _response(r: httpx.Response) -> DecodeResponse:
    import msgpack

    if r.status_code != 200:
        raise error_from_http(r.status_code, r.headers, r.content)
    return DecodeResponse.from_map(msgpack.unpackb(r.content, raw=False))


def _health(r: httpx.Response) -> dict:
    if r.status_code != 200:
        raise error_from_http(r.status_code, r.headers, r.content)
    return r.json()


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class VaeClient:
    """`retries`: extra attempts on 429/503 (backoff doubling from `backoff_s`, at least the
    server's Retry-After); `timeout`: seconds per attempt; `token`: the service's bearer token,
    when it requires one."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        timeout: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
    ):
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=_headers(token))
        self.retries, self.backoff_s = retries, backoff_s

    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        """latents: numpy array or torch tensor. options: scaling_factor, shift_factor (None = already
        scaled), height, width (packed latents), request_id, model."""
        body = pack(request_map(latents, quality, output, **options))

        def attempt() -> DecodeResponse:
            return _response(self._http.post("/decode", content=body, headers={"content-type": MSGPACK}))

        return with_retries(attempt, self.retries, self.backoff_s)

    def health(self) -> dict:
        return _health(self._http.get("/health"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VaeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncVaeClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        timeout: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
    ):
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_headers(token))
        self.retries, self.backoff_s = retries, backoff_s

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        body = pack(request_map(latents, quality, output, **options))

        async def attempt() -> DecodeResponse:
            return _response(await self._http.post("/decode", content=body, headers={"content-type": MSGPACK}))

        return await with_retries_async(attempt, self.retries, self.backoff_s)

    async def health(self) -> dict:
        return _health(await self._http.get("/health"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncVaeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
