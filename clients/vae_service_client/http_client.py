"""HTTP clients (sync and async) for `POST /decode` and `GET /health`, with retries on 429/503."""

from __future__ import annotations

import httpx

from vae_service_client.wire import (
    MSGPACK,
    DecodeResponse,
    decode_body,
    error_from,
    parse_response,
    with_retries,
    with_retries_async,
)


class VaeClient:
    """`retries`: extra attempts on 429/503 (backoff doubling from `backoff_s`, at least the
    server's Retry-After); `timeout`: seconds per attempt."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5):
        self._http = httpx.Client(base_url=base_url, timeout=timeout)
        self.retries, self.backoff_s = retries, backoff_s

    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        """latents: torch tensor or numpy array. options: scaling_factor, shift_factor (None = already
        scaled), height, width, request_id, model."""
        body = decode_body(latents, quality, output, **options)

        def attempt() -> DecodeResponse:
            r = self._http.post("/decode", content=body, headers={"content-type": MSGPACK})
            return parse_response(r.status_code, r.headers, r.content)

        return with_retries(attempt, self.retries, self.backoff_s)

    def health(self) -> dict:
        r = self._http.get("/health")
        if r.status_code != 200:
            raise error_from(r.status_code, r.headers, r.content)
        return r.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "VaeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncVaeClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5):
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self.retries, self.backoff_s = retries, backoff_s

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        body = decode_body(latents, quality, output, **options)

        async def attempt() -> DecodeResponse:
            r = await self._http.post("/decode", content=body, headers={"content-type": MSGPACK})
            return parse_response(r.status_code, r.headers, r.content)

        return await with_retries_async(attempt, self.retries, self.backoff_s)

    async def health(self) -> dict:
        r = await self._http.get("/health")
        if r.status_code != 200:
            raise error_from(r.status_code, r.headers, r.content)
        return r.json()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncVaeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
