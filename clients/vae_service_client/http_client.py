"""HTTP clients (sync and async) for `POST /decode` and `GET /health`."""

from __future__ import annotations

import httpx

from vae_service_client.wire import MSGPACK, DecodeResponse, decode_body, error_from, parse_response


class VaeClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 120.0):
        self._http = httpx.Client(base_url=base_url, timeout=timeout)

    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        """latents: torch tensor or numpy array. options: scaling_factor, shift_factor (None = already
        scaled), height, width, request_id, model."""
        r = self._http.post("/decode", content=decode_body(latents, quality, output, **options),
                            headers={"content-type": MSGPACK})
        return parse_response(r.status_code, r.headers, r.content)

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
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 120.0):
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout)

    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> DecodeResponse:
        r = await self._http.post("/decode", content=decode_body(latents, quality, output, **options),
                                  headers={"content-type": MSGPACK})
        return parse_response(r.status_code, r.headers, r.content)

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
