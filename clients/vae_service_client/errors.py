"""The error table of the wire: each error `type` with its HTTP status and gRPC code, the JSON
body and gRPC trailers that carry it, and the typed exceptions clients raise.

Server and clients share this module, so a type, its status and its code are written once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorKind:
    http_status: int
    grpc_code: str  # a grpc.StatusCode name: this module imports no grpc


ERROR_KINDS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(400, "INVALID_ARGUMENT"),
    "unauthenticated": ErrorKind(401, "UNAUTHENTICATED"),
    "body_timeout": ErrorKind(408, "DEADLINE_EXCEEDED"),
    "payload_too_large": ErrorKind(413, "RESOURCE_EXHAUSTED"),
    "unsupported_media_type": ErrorKind(415, "INVALID_ARGUMENT"),
    "decode_failed": ErrorKind(422, "INVALID_ARGUMENT"),
    "overloaded": ErrorKind(429, "RESOURCE_EXHAUSTED"),
    "out_of_memory": ErrorKind(503, "RESOURCE_EXHAUSTED"),
    "unavailable": ErrorKind(503, "UNAVAILABLE"),
    "timeout": ErrorKind(504, "DEADLINE_EXCEEDED"),
    "internal": ErrorKind(500, "INTERNAL"),
    # decode sessions (WebSocket /sessions, handles, the actor): the session's state is gone
    "session_expired": ErrorKind(410, "FAILED_PRECONDITION"),
    "session_lost": ErrorKind(503, "UNAVAILABLE"),
    # the session is leaving its replica (a drain): attach to it again (the clients do it themselves)
    "session_moved": ErrorKind(503, "UNAVAILABLE"),
    # a request's sink: its store refused the write for good (no such bucket, access denied)
    "store_refused": ErrorKind(424, "FAILED_PRECONDITION"),
}
# gRPC answers that carry no `error-type` trailer (Serve's own backpressure, transport errors)
_GRPC_FALLBACK_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
TYPE_TRAILER, FIELD_TRAILER, RETRY_TRAILER = "error-type", "error-field", "retry-after"


class VaeServiceError(Exception):
    """An error answer: the server's error `type`, the request `field` at fault and its message.
    `status` is the HTTP status of that type (gRPC answers carry the same type, hence the same
    status), None where no answer came: the connection failed (`unreachable`: nothing answered;
    `unavailable`: closed before the answer was complete; `timeout`: nothing within the client's
    `timeout`), and the message names the URL or target and the cause. `via` says where it came
    from, and the text says it the same way:

    - "http": an HTTP answer (`HTTP 400 invalid_request: ...`), or the HTTP connection failing
      (no status: `HTTP unreachable: POST http://host:8000/decode: connection refused ...`);
    - "grpc": a gRPC status, `grpc_code` (`gRPC INVALID_ARGUMENT invalid_request: ...`; grpc
      reports a failed connection as a status too: `gRPC UNAVAILABLE unreachable: host:9000: ...`);
    - "client": refused by the client before anything was sent (`invalid_request (client-side,
      nothing sent): ...`), e.g. an unknown keyword argument or a dtype the wire does not carry;
    - "answer": carried by a frame stream's last message, or raised by a Serve handle or Ray
      actor call (`invalid_request (400): ...`)."""

    def __init__(
        self,
        status: int | None,
        type_: str,
        message: str,
        field: str | None = None,
        retry_after: float | None = None,
        via: str = "http",
        grpc_code: str | None = None,
    ):
        kind = ERROR_KINDS.get(type_)
        self.status, self.type, self.message, self.field, self.retry_after = status, type_, message, field, retry_after
        self.via, self.grpc_code = via, grpc_code or (kind.grpc_code if kind else None)
        super().__init__(self._text())

    def _text(self) -> str:
        if self.via == "grpc":
            return f"gRPC {self.grpc_code} {self.type}: {self.message}"
        if self.via == "client":
            return f"{self.type} (client-side, nothing sent): {self.message}"
        if self.via == "answer":
            return f"{self.type} ({self.status}): {self.message}"
        if self.status is None:  # no HTTP answer: the connection failed
            return f"HTTP {self.type}: {self.message}"
        return f"HTTP {self.status} {self.type}: {self.message}"

    def __reduce__(self):  # crosses Ray handles intact
        args = (self.status, self.type, self.message, self.field, self.retry_after, self.via, self.grpc_code)
        return type(self), args


class InvalidRequest(VaeServiceError):
    """400/415/422: fix the request; retrying will not help."""


class Unauthenticated(VaeServiceError):
    """401: no bearer token, or not the service's (pass `token=` to the client)."""


class PayloadTooLarge(VaeServiceError):
    """413: over a byte, pixel or batch limit."""


class Overloaded(VaeServiceError):
    """429/503: retried with backoff (honouring Retry-After) before it reaches you."""


class Unavailable(Overloaded):
    """503 `unavailable`: the replica went away, a retry succeeds on another; also the connection
    closed before the answer was complete (status None), and a stream cut off after its first
    frame (which no client retries: the caller already has those frames)."""


class ServiceUnreachable(VaeServiceError):
    """Type `unreachable`, status None: nothing answered at the URL or target (connection refused,
    no such host, timed out connecting). Not retried: a wrong address or a stopped service."""


class DecodeTimeout(VaeServiceError):
    """504: the server did not finish within its request timeout; or (status None) nothing came
    within the client's `timeout` (not retried: it would take as long again)."""


class ServerError(VaeServiceError):
    """Any other 5xx: a server bug."""


class SessionExpired(VaeServiceError):
    """410 `session_expired`: the decode session was idle past the service's `sessions.idle_timeout_s`
    (or is closed) and its causal cache is gone; the message names the frames it had decoded. Not
    retried: open a new session (and replay its latents for the same frames)."""


class SessionLost(VaeServiceError):
    """`session_lost`: the replica holding the decode session went away (its causal cache with it),
    or the connection dropped mid-session; the message names the last frame received. Not an
    overload: a session client with `resume=True` replays the session's latents in a new one."""


class SessionMoved(SessionLost):
    """`session_moved`: the decode session left its replica (a scale-down, a rolling update) with its
    state kept: the session clients reconnect and attach to it on another replica by themselves (no
    latent frame replayed); a handle's caller just calls again (the router finds its new replica)."""


class StoreRefused(VaeServiceError):
    """424 `store_refused`, field `sink`: the sink's store refused the write for good (a bucket that
    does not exist, access denied, a refused credential, a name it does not take). Not retried: it
    would be refused again; the deployment's sink config or its credentials need fixing."""


def error_class(status: int, type_: str | None = None) -> type[VaeServiceError]:
    if type_ == "store_refused":
        return StoreRefused
    if type_ == "unavailable":
        return Unavailable
    if type_ == "session_lost":
        return SessionLost
    if type_ == "session_moved":
        return SessionMoved
    if type_ == "session_expired":
        return SessionExpired
    if status in (429, 503):
        return Overloaded
    if status == 413:
        return PayloadTooLarge
    if status == 504:
        return DecodeTimeout
    if status == 401:
        return Unauthenticated
    if 400 <= status < 500:
        return InvalidRequest
    return ServerError


def make_error(
    type_: str, field: str | None, message: str, retry_after: float | None = None, via: str = "answer"
) -> VaeServiceError:
    """The typed exception for a server-side error of `type_` (the handle API and frame streams
    raise these; `via` as VaeServiceError's)."""
    status = ERROR_KINDS[type_].http_status
    return error_class(status, type_)(status, type_, message, field, retry_after, via)


def connection_error(cls: type[VaeServiceError], type_: str, where: str, cause: str, **how) -> VaeServiceError:
    """The connection to `where` (a request's method and URL, or a gRPC target) failed: no answer,
    so no status; one line naming where and why (`how`: via, grpc_code)."""
    return cls(None, type_, f"{where}: {' '.join(cause.split())}", **how)


def did_you_mean(name: object, choices) -> str:
    """ "; did you mean 'quality'?" for a name close to one of `choices`, else "" (for messages
    about unknown keys, arguments and values, client- and server-side)."""
    from difflib import get_close_matches

    close = get_close_matches(str(name), [str(c) for c in choices], n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def refused_here(field: str, message: str) -> InvalidRequest:
    """A request the client refuses before sending anything (typed like the server's answer)."""
    return InvalidRequest(400, "invalid_request", f"{field}: {message}", field, via="client")


def error_json(type_: str, field: str | None, message: str) -> bytes:
    return json.dumps({"error": {"type": type_, "field": field, "message": message}}).encode()


def grpc_trailers(type_: str, field: str | None, retry_after: float | None) -> list[tuple[str, str]]:
    """The error's type and field as trailing metadata (Serve's gRPC proxy forwards a list)."""
    trailers = [(TYPE_TRAILER, type_)]
    if field:
        trailers.append((FIELD_TRAILER, field))
    if retry_after is not None:
        trailers.append((RETRY_TRAILER, f"{retry_after:g}"))
    return trailers


def error_from_http(status: int, headers, content: bytes) -> VaeServiceError:
    retry = headers.get("retry-after")
    try:
        err = json.loads(content)["error"]
        type_, message, field = err.get("type", "error"), err.get("message", ""), err.get("field")
    except (ValueError, KeyError, TypeError):
        type_, message, field = "error", content[:500].decode(errors="replace"), None
    return error_class(status, type_)(status, type_, message, field, _seconds(retry))


def error_from_grpc(code_name: str, details: str | None, trailers) -> VaeServiceError:
    meta = dict(trailers or ())
    type_ = meta.get(TYPE_TRAILER)
    status = ERROR_KINDS[type_].http_status if type_ in ERROR_KINDS else _GRPC_FALLBACK_STATUS.get(code_name, 500)
    type_ = type_ or code_name.lower()
    return error_class(status, type_)(
        status,
        type_,
        details or "",
        meta.get(FIELD_TRAILER),
        _seconds(meta.get(RETRY_TRAILER)),
        via="grpc",
        grpc_code=code_name,
    )


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
