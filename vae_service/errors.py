"""Errors that reach a client. Each names the request field at fault and carries its HTTP status,
so every layer (protocol, engine, serving) can raise the same kind and the ingress maps it once."""

from __future__ import annotations


class RequestError(Exception):
    """Bad input: the client can fix it. Never a 500."""

    status = 400
    type = "invalid_request"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"

    def to_json(self) -> dict:
        return {"error": {"type": self.type, "field": self.field, "message": self.message}}


class PayloadTooLarge(RequestError):
    status = 413
    type = "payload_too_large"


class UnsupportedMediaType(RequestError):
    status = 415
    type = "unsupported_media_type"


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded (bad path, unreachable hub, unsupported class)."""


class DecodeFailed(RequestError):
    """The decode itself produced no usable output for this input (e.g. NaN/Inf from overflow)."""

    status = 422
    type = "decode_failed"


class Overloaded(RequestError):
    """Too much queued work (or no device memory for it): retry after `retry_after_s`."""

    status = 429
    type = "overloaded"

    def __init__(self, field: str, message: str, retry_after_s: float, status: int = 429):
        super().__init__(field, message)
        self.retry_after_s = retry_after_s
        self.status = status


class DecodeTimeout(RequestError):
    status = 504
    type = "timeout"
