"""Admission: what a request must pass before any decode work (its bearer token, its body's size
and its body's deadline), in one place, built from ServiceConfig. The proxy guard (in Serve's HTTP
proxy, before a replica holds the request), the routing ingress and the replicas (HTTP routes and
gRPC methods) all check through an `Admission`, with the same answers: 401 `unauthenticated`,
413 `payload_too_large`, 408 `body_timeout` (400 for a Content-Length that is no number).

Order: the token first (from the headers, before a body byte is read), then the declared
Content-Length, then the body itself, whole within `limits.body_timeout_s` and never past
`limits.max_request_bytes`.

Serve's HTTP proxy takes its settings only from the environment (proxy_guard.py), so an Admission
travels there as one variable, ADMISSION_ENV: its fields, taken from ServiceConfig by
`admission_settings`, as JSON (`settings_env`; read back by `Admission.from_env`; the proxy guard's
`proxy_guard_env(config)` gives the whole environment). The token itself never does: it is read from
`auth_token_file`, or else VAE_SERVICE_AUTH_TOKEN, where the Admission is built (so the file must
be readable on every node that runs a proxy).

Serve's proxy imports this module: it imports neither torch nor the engine (nor vae_service.config,
which imports the fast path). Its checks raise `AdmissionRefused`, which the proxy answers from the wire's
error table; `check`, `check_grpc` and `admit` (replicas, router) raise the protocol's errors
instead, which their callers catch as ANSWERABLE.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import os
import re
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vae_service_client.errors import ERROR_KINDS, error_json

if TYPE_CHECKING:
    from starlette.requests import Request

    from vae_service.config import Limits, ServiceConfig

ADMISSION_ENV = "VAE_SERVICE_ADMISSION"
TOKEN_ENV = "VAE_SERVICE_AUTH_TOKEN"
# the routes behind the bearer token, under any route prefix (Serve's own /-/healthz and /-/routes
# stay open: liveness probes carry no token)
AUTHENTICATED_ROUTES = ("/decode", "/remote-decode", "/health")
# the viewers' routes (serving/wire/watch_routes.py) check a session's watch token themselves: the page
# carries none, and a viewer holds a session's token, not the service's
WATCH_ROUTE = re.compile(r"/watch/[^/]+/(stream|whep(/[^/]+)?)/?$")
WATCH_BODY_BYTES = 32 * 1024  # what a viewer may send without the service's token: an SDP offer


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header: the scheme in any case (RFC 7235),
    one or more spaces before the token; None for another scheme or none."""
    scheme, _, credentials = (authorization or "").partition(" ")
    token = credentials.lstrip(" ")
    return token if scheme.lower() == "bearer" and token else None


TOKEN_REQUIRED = "a valid bearer token is required ('Authorization: Bearer ...')"


def load_token(token_file: str | None) -> str | None:
    """The bearer token: `auth_token_file`'s content, else $VAE_SERVICE_AUTH_TOKEN, else none."""
    if token_file:
        token = Path(token_file).expanduser().read_text().strip()
        if not token:
            raise ValueError(f"auth_token_file: {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


# set by the proxy guard on a request whose body it read whole (a client's own is dropped there)
BODY_ADMITTED_HEADER = "x-vae-body-admitted"


class AdmissionRefused(Exception):
    """A request refused at admission, as the wire's error type, field and message."""

    def __init__(self, type_: str, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.type, self.field, self.message = type_, field, message

    @property
    def http_status(self) -> int:
        return ERROR_KINDS[self.type].http_status

    def http_body(self) -> bytes:
        """The same JSON a replica answers (protocol.errors.WireErrorInfo.http_body)."""
        return error_json(self.type, self.field, f"{self.field}: {self.message}")

    def http_headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if self.type == "unauthenticated" else {}

    def answerable(self) -> Exception:
        """The protocol's error for it (what replicas and the router catch as ANSWERABLE).
        Imported here, not at the top: the proxy, which never calls this, must not load the engine."""
        from vae_service.engine.request.errors import InvalidInput, LimitExceeded
        from vae_service.protocol.errors import BodyTimeout, Unauthenticated

        cls = {
            "unauthenticated": Unauthenticated,
            "payload_too_large": LimitExceeded,
            "body_timeout": BodyTimeout,
            "invalid_request": InvalidInput,
        }[self.type]
        return cls(self.field, self.message)


def admission_settings(configs: Iterable[ServiceConfig]) -> dict:
    """An Admission's fields from one ServiceConfig, or from several behind one ingress or one
    proxy: the largest body and deadline any of them accepts (each replica then applies its own),
    one token file. Reads no token (an application may be built where its token file is not)."""
    configs = list(configs)
    if not configs:
        raise ValueError("models: give at least one model config")
    token_files = {c.auth_token_file for c in configs}
    if len(token_files) != 1:
        raise ValueError(f"models: one application has one bearer token; auth_token_file differs: {token_files}")
    return {
        "max_request_bytes": max(c.limits.max_request_bytes for c in configs),
        "body_timeout_s": max(c.limits.body_timeout_s for c in configs),
        "retry_after_s": max(c.serving.retry_after_s for c in configs),
        "auth_token_file": token_files.pop(),
    }


def settings_env(settings: dict) -> str:
    """ADMISSION_ENV's value for an Admission's fields."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Admission:
    max_request_bytes: int
    body_timeout_s: float
    retry_after_s: float = 1.0  # `Retry-After` of a request lost with its replica (proxy guard)
    auth_token_file: str | None = None
    # the token, read once where the Admission is built: not a setting, never compared or sent
    _expected: bytes | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.max_request_bytes, int) and self.max_request_bytes > 0):
            raise ValueError(f"max_request_bytes: must be a positive integer, got {self.max_request_bytes!r}")
        if not (isinstance(self.body_timeout_s, int | float) and self.body_timeout_s > 0):
            raise ValueError(f"body_timeout_s: must be a positive number, got {self.body_timeout_s!r}")
        if not (isinstance(self.retry_after_s, int | float) and self.retry_after_s >= 0):
            raise ValueError(f"retry_after_s: must be a number >= 0, got {self.retry_after_s!r}")
        token = load_token(self.auth_token_file)
        object.__setattr__(self, "_expected", token.encode() if token else None)

    # ---- built from the config -----------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ServiceConfig) -> Admission:
        return cls(**admission_settings([config]))

    @classmethod
    def for_configs(cls, configs: Iterable[ServiceConfig]) -> Admission:
        """One ingress (or one proxy) in front of several models (admission_settings)."""
        return cls(**admission_settings(configs))

    def with_limits(self, limits: Limits) -> Admission:
        """The same token under other limits (a replica's `limits` are live: Serve's user_config).
        The token file is not read again."""
        changed = copy.copy(self)
        object.__setattr__(changed, "max_request_bytes", limits.max_request_bytes)
        object.__setattr__(changed, "body_timeout_s", limits.body_timeout_s)
        return changed

    # ---- through the environment (Serve's proxy) --------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Admission:
        """The Admission ADMISSION_ENV holds (unset: ServiceConfig's defaults)."""
        environ = os.environ if environ is None else environ
        legacy = sorted(name for name in environ if name.startswith("VAE_SERVICE_PROXY_"))
        if legacy:  # settings no longer read: refuse rather than run with others than intended
            raise ValueError(f"{legacy} are no longer read: set {ADMISSION_ENV} (proxy_guard_env(config))")
        raw = environ.get(ADMISSION_ENV)
        if not raw:  # ServiceConfig's defaults (a unit test holds them equal)
            return cls(max_request_bytes=64 * 1024 * 1024, body_timeout_s=30.0)
        try:
            settings = json.loads(raw)
            if not isinstance(settings, dict):
                raise ValueError("must be a JSON object")
            return cls(**settings)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{ADMISSION_ENV}={raw!r}: {exc}") from None

    # ---- the bearer token ------------------------------------------------------------------
    @property
    def required(self) -> bool:
        """Whether callers must send the token (one is configured)."""
        return self._expected is not None

    def refuse_token(self, authorization: str | None) -> None:
        """Raise AdmissionRefused unless `authorization` is `Bearer <token>` (or no token is configured).
        The scheme in any case (RFC 7235: `Bearer`, `bearer`, `BEARER`), one or more spaces before the
        token; the token itself compared in constant time. A missing token gets the same answer as a
        wrong one."""
        if self._expected is None:
            return
        given = (bearer_token(authorization) or "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise AdmissionRefused("unauthenticated", "Authorization", TOKEN_REQUIRED)

    def check(self, authorization: str | None) -> None:
        """Raise the protocol's Unauthenticated unless `authorization` is `Bearer <token>`."""
        try:
            self.refuse_token(authorization)
        except AdmissionRefused as exc:
            raise exc.answerable() from None

    def check_grpc(self, grpc_context) -> None:
        self.check(dict(grpc_context.invocation_metadata() or ()).get("authorization"))

    def protects(self, path: str, carries_body: bool = True) -> bool:
        """Whether a request for `path` (under any route prefix) must carry the token: the decode
        and health routes always; any other route (API docs, unknown paths) when the request
        carries a body, so no body is buffered for a caller without the token; Serve's own
        probes (/-/...) never."""
        if not self.required or path.startswith("/-/") or WATCH_ROUTE.search(path):
            return False
        return path.rstrip("/").endswith(AUTHENTICATED_ROUTES) or carries_body

    # ---- the body --------------------------------------------------------------------------
    def refuse_declared(self, content_length: str | None, limit: int | None = None) -> None:
        """A declared Content-Length over the budget is refused before a byte is read."""
        if content_length is None:
            return
        if not content_length.isdigit():
            raise AdmissionRefused("invalid_request", "Content-Length", f"must be an integer, got {content_length!r}")
        self._refuse_size(int(content_length), limit)

    def _refuse_size(self, size: int, limit: int | None = None) -> None:
        limit = self.max_request_bytes if limit is None else limit
        if size > limit:
            why = "max_request_bytes" if limit == self.max_request_bytes else "without the service's token"
            raise AdmissionRefused("payload_too_large", "body", f"{size} bytes is over the limit of {limit} ({why})")

    async def read_body(self, chunks: AsyncIterator[bytes], limit: int | None = None) -> bytes:
        """The body whole within the deadline and under the budget: one still arriving at the
        deadline is cut off (408), one growing past the budget as soon as it does (413)."""
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in chunks:
                    size += len(chunk)
                    self._refuse_size(size, limit)  # longer than declared: cut off too
                    parts.append(chunk)
        except TimeoutError:
            raise AdmissionRefused(
                "body_timeout", "body", f"did not arrive within {self.body_timeout_s:g} s (body_timeout_s)"
            ) from None
        return b"".join(parts)

    async def screen(self, request: Request, authenticate: bool = True) -> bytes:
        """A request's body once it passed: token (before any body byte), declared size, body.
        Raises AdmissionRefused; a client that goes away meanwhile, starlette's ClientDisconnect."""
        if authenticate:
            self.refuse_token(request.headers.get("authorization"))
        # a viewer's route takes the session's token, checked by the replica: its body is bounded here
        limit = None if authenticate or not WATCH_ROUTE.search(request.url.path) else WATCH_BODY_BYTES
        self.refuse_declared(request.headers.get("content-length"), limit)
        return await self.read_body(request.stream(), limit)

    async def admit(self, request: Request, authenticate: bool = True) -> bytes:
        """`screen` for replicas and the router: raises the protocol's errors (ANSWERABLE). A body
        the proxy guard already had whole (BODY_ADMITTED_HEADER) that does not come through in
        time stalled in Serve's relay to this replica (its node going away, seen when a raylet
        was killed), not at the client: 503 + Retry-After, retried by clients, never the 408 that
        blames the client."""
        try:
            return await self.screen(request, authenticate)
        except AdmissionRefused as exc:
            if exc.type == "body_timeout" and request.headers.get(BODY_ADMITTED_HEADER) == "1":
                from vae_service.protocol.errors import Unavailable  # not at the top: see `answerable`

                why = "the body the proxy received did not come through to the replica; retry"
                raise Unavailable("body", why, self.retry_after_s) from None
            raise exc.answerable() from None
