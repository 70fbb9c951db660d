"""An ASGI middleware for Serve's HTTP proxy, in front of every replica, checking through the
service's `Admission` (admission.py) before a replica holds a request:

- the bearer token (when one is configured) of /decode, /remote-decode and /health, under any
  route prefix, before a body byte is read: 401, the replica's own answer (Serve's /-/healthz and
  /-/routes stay open);
- a declared Content-Length over the byte budget: 413 before a byte is read;
- the body must arrive whole within the deadline (408) and no larger than the budget (413):
  Serve's proxy otherwise streams whatever trickles in to a replica, holding one of its request
  slots for as long as a slow client likes;
- FastAPI's API docs (/docs, /redoc, /openapi.json, under any prefix) need the token too when one
  is configured (the multi-model router's as well as the replicas');
- a WebSocket handshake (decode sessions) without the token is refused before the upgrade (401),
  and the proxy's WebSocket message limit follows `limits.max_request_bytes`
  (websocket_message_limit: a message over the bound reaches the replica, which answers 413);
- a request that reaches no answer because its replica died (Serve's proxy then sends nothing and
  returns, and uvicorn would answer 500) gets 503 + Retry-After: decoding is idempotent, the retry
  succeeds on another replica. An exception out of the proxy is a bug, not a lost replica (Serve's
  proxy catches a replica's loss itself): 500 `internal`, logged with an id, never 503.

Ray Serve 2.60 installs proxy middlewares only from the environment of the cluster it runs in
(`http_options.middlewares` was removed): RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH naming
`vae_service.serving.wire.proxy_guard:middlewares`, and the Admission's settings, derived from the
ServiceConfig, in VAE_SERVICE_ADMISSION. `proxy_guard_env(config)` gives both; the CLI sets them
before it starts a local Ray; for `serve run`/`serve deploy` on a cluster of your own, or KubeRay,
set them in the nodes' environment (deploy/rayservice.yaml does). One proxy serves every
application of the cluster: its settings are the cluster's (the largest limits, one token).

Installed, the guard also makes the proxy's HTTP and gRPC ports its own (`bind_exclusively`):
Serve binds them with SO_REUSEPORT, and a second Serve on the same host and port then starts
without an error while the kernel splits connections between the two (another model's pixels, no
error). `vae-service guard-env FILE.yaml` prints the environment for a YAML's applications; a
replica started without it warns (`missing_guard_warning`).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request

from vae_service.serving.scheduling.admission import (
    ADMISSION_ENV,
    BODY_ADMITTED_HEADER,
    Admission,
    AdmissionRefused,
    admission_settings,
    settings_env,
)
from vae_service_client.errors import ERROR_KINDS, error_json

if TYPE_CHECKING:
    from vae_service.config import ServiceConfig

log = logging.getLogger("ray.serve")  # the proxy's own log file
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = f"{__name__}:middlewares"
# FastAPI's API documentation, under any route prefix: behind the token where one is configured
DOCS_ROUTES = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class ProxyGuard:
    def __init__(self, app, admission: Admission | None = None):
        self.app = app
        self.admission = admission if admission is not None else Admission.from_env()

    def protects(self, path: str, carries_body: bool) -> bool:
        docs = self.admission.required and path.rstrip("/").endswith(DOCS_ROUTES)
        return docs or self.admission.protects(path, carries_body)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission, request = self.admission, Request(scope, receive)
        carries_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        try:
            body = await admission.screen(request, authenticate=self.protects(scope["path"], carries_body))
        except AdmissionRefused as exc:
            await _answer(send, exc.http_status, exc.http_body(), exc.http_headers())
            return
        except ClientDisconnect:
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

        admitted = BODY_ADMITTED_HEADER.encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != admitted]
        scope = {**scope, "headers": [*headers, (admitted, b"1")]}
        try:
            await self.app(scope, replay, tracking_send)
        except Exception as exc:
            if started:  # half an answer went out: only closing the connection tells the client
                raise
            error_id = uuid.uuid4().hex[:12]
            log.error(
                "internal error %s in the proxy, %s %s", error_id, scope.get("method"), scope["path"], exc_info=exc
            )
            answer = error_json("internal", None, f"internal error {error_id} (see the server log)")
            await _answer(send, ERROR_KINDS["internal"].http_status, answer)
            return
        if not started and not client_gone:  # the proxy got no answer from a replica: it died with the request
            retry_after = str(max(1, round(admission.retry_after_s)))
            answer = error_json("unavailable", None, "the replica holding this request went away; retry")
            await _answer(send, ERROR_KINDS["unavailable"].http_status, answer, {"Retry-After": retry_after})

    async def websocket(self, scope, receive, send) -> None:
        """A WebSocket handshake (the decode sessions' /sessions) without the token is refused before
        the upgrade: 401 with the replica's JSON error where the server speaks ASGI's WebSocket
        denial response (uvicorn does), else a close before the accept (the server answers the
        handshake 403). With the token, or none configured, the handshake goes on to Serve."""
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        authorization = headers.get(b"authorization")
        try:
            if self.admission.protects(scope["path"], carries_body=True):
                self.admission.refuse_token(authorization.decode("latin-1") if authorization else None)
        except AdmissionRefused as exc:
            if (await receive())["type"] != "websocket.connect":
                return  # the client went away
            if "websocket.http.response" in (scope.get("extensions") or {}):
                await _answer(send, exc.http_status, exc.http_body(), exc.http_headers(), "websocket.http.response")
            else:
                await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": ""})
            return
        await self.app(scope, receive, send)


POLICY_VIOLATION = 1008  # RFC 6455's close code for a refused peer


async def _answer(
    send, status: int, body: bytes, headers: dict[str, str] | None = None, kind: str = "http.response"
) -> None:
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": f"{kind}.start", "status": status, "headers": raw_headers})
    await send({"type": f"{kind}.body", "body": body})


def proxy_guard_env(config: ServiceConfig | Iterable[ServiceConfig] | None = None) -> dict[str, str]:
    """The environment that makes Serve's proxy install the guard with the Admission of `config`
    (a ServiceConfig, or several for one cluster serving several models; default: the defaults).
    Set it before Ray starts on every node that runs a proxy. Reads no token."""
    from vae_service.config import ServiceConfig  # not at the top: the proxy imports this module

    configs = [config or ServiceConfig()] if config is None or isinstance(config, ServiceConfig) else list(config)
    return {CALLBACK_ENV: CALLBACK, ADMISSION_ENV: settings_env(admission_settings(configs))}


def missing_guard_warning() -> str | None:
    """Why this process's cluster runs without the guard (its proxy and replicas share the
    raylet's environment), or None: a replica logs it at start (`serve run FILE.yaml` in a shell
    without the guard's environment)."""
    if os.environ.get(CALLBACK_ENV) == CALLBACK:
        return None
    return (
        "no proxy guard (token, body limits, own ports) in Serve's proxy: "
        'eval "$(vae-service guard-env FILE.yaml)" before serve run FILE.yaml'
    )


def bind_exclusively() -> None:
    """Make this proxy's ports its own: HTTP binds with SO_REUSEADDR but without SO_REUSEPORT (a
    restart still binds over the last run's TIME_WAIT connections), gRPC with
    grpc.so_reuseport 0 (gRPC sets SO_REUSEADDR itself). A port another process holds then fails
    the proxy's bind instead of sharing it. Serve 2.60's one switch cannot do it:
    SERVE_SOCKET_REUSE_PORT_ENABLED=0 drops SO_REUSEADDR too (a restart within a minute of closed
    connections would fail), and gRPC keeps SO_REUSEPORT anyway (Serve passes the option as the
    string "0", which gRPC ignores; it reads an int). Hence these two replacements of Serve's
    binding helpers, made in the proxy process before it binds (its callback runs first)."""
    from ray.serve._private import grpc_util, http_util

    if getattr(grpc_util.gRPCGenericServer, "exclusive", False):
        return

    def reuse_address_only(sock: socket.socket) -> bool:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return True

    class ExclusiveGrpcServer(grpc_util.gRPCGenericServer):
        exclusive = True

        def __init__(self, service_handler_factory, *, extra_options=None):
            kept = [(k, v) for k, v in extra_options or [] if k != "grpc.so_reuseport"]
            super().__init__(service_handler_factory, extra_options=[*kept, ("grpc.so_reuseport", 0)])

    http_util.set_socket_reuse_port = reuse_address_only
    grpc_util.gRPCGenericServer = ExclusiveGrpcServer


def websocket_message_limit(max_request_bytes: int) -> int:
    """The largest WebSocket message the proxy takes in: twice `limits.max_request_bytes`, so that
    a message over the bound reaches the replica, whose bounded parse answers it 413 naming
    `latents` with the session kept (protocol/sessions.py's parse_message). Past twice the bound
    the proxy's WebSocket layer closes the connection with 1009 (message too big) as soon as the
    frame's header says its size, before its payload is read (the client raises 413 naming
    `latents`; the session is gone)."""
    return 2 * max_request_bytes


class _SizedUvicorn:
    """The `uvicorn` module as Serve's http_util sees it, its Config taking `ws_max_size`."""

    def __init__(self, module, config: type):
        self._module, self.Config = module, config

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def sized_uvicorn(module, ws_max_size: int):
    """`module` (uvicorn) whose Config defaults to WebSocket messages of up to `ws_max_size` bytes."""
    base = module.Config

    class SizedConfig(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("ws_max_size", ws_max_size)
            super().__init__(*args, **kwargs)

    return _SizedUvicorn(module, SizedConfig)


def size_websocket_messages(admission: Admission) -> None:
    """Serve 2.60 builds its proxy's uvicorn.Config itself (http_util.start_asgi_http_server) without
    `ws_max_size`: uvicorn's default, 16 MiB, would close a session's chunk between 16 MiB and
    `max_request_bytes` (64 MiB by default) with 1009 and lose the session. The proxy's http_util
    is given a uvicorn whose Config defaults to websocket_message_limit (made in the proxy process
    before it starts its server: its callback runs first)."""
    import uvicorn
    from ray.serve._private import http_util

    http_util.uvicorn = sized_uvicorn(uvicorn, websocket_message_limit(admission.max_request_bytes))


def middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH points Serve's proxy at (called once, when
    the proxy starts, before it binds its ports: an unreadable token file or a bad
    VAE_SERVICE_ADMISSION fails it loudly)."""
    admission = Admission.from_env()
    bind_exclusively()
    size_websocket_messages(admission)
    return [Middleware(ProxyGuard, admission=admission)]
