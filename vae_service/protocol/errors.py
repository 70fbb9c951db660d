"""The one table from exception classes to wire error types; the type's HTTP status and gRPC
code come from the wire's own table (vae_service_client.errors). Also the protocol's own error:
a wrong Content-Type."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from vae_service.engine.request.errors import (
    DecodeError,
    DecodeFailed,
    DecodeTimeout,
    EncodeFailed,
    InvalidInput,
    LimitExceeded,
    OutOfMemory,
    Overloaded,
    StoreRefused,
    Unavailable,
)
from vae_service.engine.request.session import SessionExpired, SessionLost, SessionMoved
from vae_service_client.errors import ERROR_KINDS, VaeServiceError, error_json, grpc_trailers, make_error
from vae_service_client.tensors import WireError

log = logging.getLogger(__name__)


class UnsupportedMediaType(InvalidInput):
    """The body's Content-Type is not one this route reads."""


class BodyTimeout(InvalidInput):
    """The request body did not arrive within the deadline (a slow or stalled client)."""


class Unauthenticated(DecodeError):
    """No bearer token, or not the service's (the same answer for both)."""


# most specific first: the first class an exception is an instance of decides its type
WIRE_TYPES: tuple[tuple[type[Exception], str], ...] = (
    (Unauthenticated, "unauthenticated"),
    (SessionExpired, "session_expired"),
    (SessionLost, "session_lost"),
    (SessionMoved, "session_moved"),
    (UnsupportedMediaType, "unsupported_media_type"),
    (BodyTimeout, "body_timeout"),
    (LimitExceeded, "payload_too_large"),
    (InvalidInput, "invalid_request"),
    (WireError, "invalid_request"),
    (DecodeFailed, "decode_failed"),
    (OutOfMemory, "out_of_memory"),
    (StoreRefused, "store_refused"),
    (Unavailable, "unavailable"),
    (Overloaded, "overloaded"),
    (DecodeTimeout, "timeout"),
    (EncodeFailed, "internal"),
)
ANSWERABLE = tuple(dict.fromkeys(cls for cls, _ in WIRE_TYPES))  # what becomes a 4xx/503/504 answer, never a 500


@dataclass(frozen=True)
class WireErrorInfo:
    type: str
    field: str | None
    message: str
    retry_after_s: float | None

    @property
    def http_status(self) -> int:
        return ERROR_KINDS[self.type].http_status

    @property
    def grpc_code(self) -> str:
        return ERROR_KINDS[self.type].grpc_code

    def http_body(self) -> bytes:
        return error_json(self.type, self.field, self.message)

    def http_headers(self) -> dict[str, str]:
        if self.type == "unauthenticated":
            return {"WWW-Authenticate": "Bearer"}
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}

    def grpc_trailers(self) -> list[tuple[str, str]]:
        return grpc_trailers(self.type, self.field, self.retry_after_s)

    def client_error(self) -> VaeServiceError:
        """What a client would raise for this answer (the handle API raises it directly)."""
        return make_error(self.type, self.field, self.message, self.retry_after_s)


def error_type(exc: BaseException) -> str:
    for cls, type_ in WIRE_TYPES:
        if isinstance(exc, cls):
            return type_
    raise TypeError(f"{type(exc).__name__} is not an answerable error") from exc


def internal_error(exc: BaseException, where: str) -> WireErrorInfo:
    """A bug met after an answer began (a stream): logged with an id; the client gets the id as the
    stream's last message, never the exception's text."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s in %s", error_id, where, exc_info=exc)
    return WireErrorInfo("internal", None, f"internal error {error_id} (see the server log)", None)


def wire_error(exc: BaseException) -> WireErrorInfo:
    return WireErrorInfo(
        error_type(exc),
        getattr(exc, "field", None),
        getattr(exc, "message", str(exc)),
        getattr(exc, "retry_after_s", None),
    )
