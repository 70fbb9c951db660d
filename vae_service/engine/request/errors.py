"""The engine's domain errors. Each names the request field at fault; none carries a transport
code: the protocol layer maps them to HTTP statuses and gRPC codes in one table."""

from __future__ import annotations


class DecodeError(Exception):
    """A request the service answers with an error instead of an output. Never a server bug."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


class InvalidInput(DecodeError):
    """Bad input: the client can fix it."""


class LimitExceeded(InvalidInput):
    """Over a configured budget (bytes, pixels, batch items); refused before any tensor work."""


class DecodeFailed(DecodeError):
    """The decoder produced no usable output for these latents (NaN/Inf, e.g. overflow)."""


class EncodeFailed(DecodeError):
    """Encoding the decoded pixels as a file failed: a server fault (sizes are checked before the
    decode), answered as an internal error of that request alone."""


class Overloaded(DecodeError):
    """Too much queued work: retry after `retry_after_s`."""

    def __init__(self, field: str, message: str, retry_after_s: float):
        super().__init__(field, message)
        self.retry_after_s = retry_after_s


class Unavailable(Overloaded):
    """A replica that held the request, or a tile of it, went away (killed, crashed, scaled down
    hard). Decoding is idempotent, so the client's retry after `retry_after_s` succeeds on another."""


class StoreRefused(DecodeError):
    """The store a request's files go to refused them for good (no such bucket, access denied): a
    retry would be refused again."""


class OutOfMemory(Overloaded):
    """The device ran out of memory for this request; another attempt (or fewer items) may fit."""


class DecodeTimeout(DecodeError):
    """Not decoded within the request timeout."""


class DecodeAbandoned(DecodeTimeout):
    """A decode stopped early because every request in it timed out or went away."""


class WrongFingerprint(DecodeError):
    """A tile offered by a replica whose engine decodes other bits (another model, weights,
    precision, fast path, thread count or version): refused, so that it is never blended into that
    replica's answer; the requester decodes the tile itself."""
