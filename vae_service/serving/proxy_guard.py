"""An ASGI middleware for Serve's HTTP proxy, in front of every replica:

- a declared Content-Length over the byte budget is refused (413) before a byte is read;
- the body must arrive whole within a deadline (408), and no larger than the budget (413): Serve's
  proxy otherwise streams whatever trickles in to a replica, holding one of its request slots for
  as long as a slow client likes;
- a request that reaches no answer because its replica died (the proxy then sends nothing and
  uvicorn would answer 500) gets 503 + Retry-After: decoding is idempotent, the retry succeeds on
  another replica.

Ray Serve 2.60 installs proxy middlewares only from the environment of the cluster it runs in
(`http_options.middlewares` was removed): RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH naming
`vae_service.serving.proxy_guard:middlewares`. `proxy_guard_env()` gives the variables; the CLI sets
them before it starts a local Ray; for `serve run`/`serve deploy` on a cluster of your own, or
KubeRay, set them in the nodes' environment (deploy/rayservice.yaml does). Settings:
VAE_SERVICE_PROXY_MAX_BODY_BYTES, VAE_SERVICE_PROXY_BODY_TIMEOUT_S, VAE_SERVICE_PROXY_RETRY_AFTER_S.
"""

from __future__ import annotations

import asyncio
import os

from starlette.middleware import Middleware

from vae_service_client.errors import ERROR_KINDS, error_json

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_RETRY_AFTER_S = 1.0


class ProxyGuard:
    def __init__(
        self,
        app,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.body_timeout_s, self.retry_after_s = body_timeout_s, retry_after_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _error(
                send,
                "payload_too_large",
                "body",
                f"{int(declared)} bytes is over the limit of {self.max_body_bytes} (max_request_bytes)",
            )
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            await _error(send, "body_timeout", "body", f"did not arrive within {self.body_timeout_s:g} s")
            return
        except _TooLarge as exc:
            await _error(send, "payload_too_large", "body", str(exc))
            return
        if body is None:  # the client went away
            return
        started = client_gone = False

        async def replay():
            nonlocal body, client_gone
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            message = await receive()  # then: the disconnect, whenever it comes
            client_gone = message["type"] == "http.disconnect"
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracking_send)
        except Exception:
            if started:
                raise
        if not started and not client_gone:  # the proxy got no answer from a replica: it died with the request
            await _error(
                send,
                "unavailable",
                None,
                "the replica holding this request went away; retry",
                {"retry-after": str(max(1, round(self.retry_after_s)))},
            )

    async def _read(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge(f"over the limit of {self.max_body_bytes} bytes (max_request_bytes)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


async def _error(send, type_: str, field: str | None, message: str, headers: dict[str, str] | None = None) -> None:
    body = error_json(type_, field, f"{field}: {message}" if field else message)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": ERROR_KINDS[type_].http_status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def proxy_guard_env(
    max_body_bytes: int | None = None, body_timeout_s: float | None = None, retry_after_s: float | None = None
) -> dict[str, str]:
    """The environment that makes Serve's proxy install the guard (set it before Ray starts)."""
    env = {CALLBACK_ENV: f"{__name__}:middlewares"}
    for name, value in (
        ("MAX_BODY_BYTES", max_body_bytes),
        ("BODY_TIMEOUT_S", body_timeout_s),
        ("RETRY_AFTER_S", retry_after_s),
    ):
        if value is not None:
            env[f"VAE_SERVICE_PROXY_{name}"] = str(value)
    return env


def middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH points Serve's proxy at."""
    env = os.environ.get
    return [
        Middleware(
            ProxyGuard,
            max_body_bytes=int(env("VAE_SERVICE_PROXY_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)),
            body_timeout_s=float(env("VAE_SERVICE_PROXY_BODY_TIMEOUT_S", DEFAULT_BODY_TIMEOUT_S)),
            retry_after_s=float(env("VAE_SERVICE_PROXY_RETRY_AFTER_S", DEFAULT_RETRY_AFTER_S)),
        )
    ]
