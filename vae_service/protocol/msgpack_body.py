"""A `POST /decode` body's bytes, before any field is read: Content-Type, size, and one bounded walk
of its msgpack that both the replica's parse (`unpack_body`) and the router's peek at its routing
keys (`peek_routing`) go through, so both refuse the same bodies with the same answer, in constant
work: a hostile body is refused, never walked. Fields become a DecodeRequest in protocol/requests.py."""

from __future__ import annotations

import msgpack

from vae_service.engine.request.errors import InvalidInput, LimitExceeded
from vae_service.protocol.errors import UnsupportedMediaType
from vae_service_client.messages import MSGPACK_TYPES, REQUEST_KEYS, request_fields
from vae_service_client.tensors import MAX_NDIM


def check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";")[0].strip().lower()
    if media not in MSGPACK_TYPES:
        raise UnsupportedMediaType("Content-Type", f"must be application/msgpack, got {content_type or 'nothing'!r}")


def check_body_present(body: bytes) -> None:
    """An empty body is a request without its map: named as the body, before its Content-Type (a
    client that sent nothing often sent no Content-Type either, and that is not what to fix)."""
    if not body:
        raise InvalidInput("body", "is empty: POST /decode takes a msgpack map with at least `latents`")


def check_body_size(size: int, max_request_bytes: int) -> None:
    if size > max_request_bytes:
        raise LimitExceeded("body", f"{size} bytes is over the limit of {max_request_bytes} (max_request_bytes)")


def _refuse_ext(code: int, data: bytes) -> None:
    raise InvalidInput("body", f"msgpack extension types are not accepted (ext code {code})")


# ---- the bounds of a /decode body --------------------------------------------------------------
# A /decode body is one map of at most len(REQUEST_KEYS) keys, a 3-key tensor map and a shape of
# at most MAX_NDIM dims: 3 containers deep, a few dozen msgpack values in all. Anything bigger is
# malformed. Without these bounds a 24 MiB body of millions of empty arrays took 3.5 s to parse
# here, the router's peek walked a 30 MiB one for 3.6-8 s on its event loop, and 270 KiB of arrays
# of 12, each within the container bounds, nested 6 deep, took the parse 0.5 s (and memory that
# grows 12-fold a level); with them each is refused in microseconds.
_CONTAINER_BOUNDS = {
    "max_map_len": 2 * len(REQUEST_KEYS),
    "max_array_len": 2 * MAX_NDIM,
    "max_str_len": 1024,
    "max_ext_len": 16,  # the ext_hook refuses every extension, with a message saying so
}
MAX_DEPTH = 4  # containers within containers: 3 in a /decode body (body, latents, shape), and one to spare
MAX_VALUES = 1024  # msgpack values in all (containers, keys, scalars): a /decode body has a few dozen


def unpack_options(max_request_bytes: int) -> dict:
    """msgpack's own parser, bounded as a /decode body is (msgpack.unpackb's keyword arguments).
    It has no depth or value-count bound: `_Walk` adds them, and runs first."""
    return {
        "raw": False,
        "ext_hook": _refuse_ext,
        "strict_map_key": True,
        "max_bin_len": max_request_bytes,
        **_CONTAINER_BOUNDS,
    }


# ---- why a body is refused, in the request's terms ----------------------------------------------
TRUNCATED = "it ends early (truncated)"
EXTRA_DATA = "bytes follow the first msgpack object (send one map, Content-Type application/msgpack)"
NOT_UTF8 = "a string is not UTF-8 (binary data goes in msgpack bin, not str)"
TOO_DEEP = "nested deeper than a /decode body ever is"
TOO_MANY = f"more values than a /decode body ever has (at most {MAX_VALUES} msgpack values)"
OVER_BOUNDS = (
    f"a map, array or string is over the bounds of a /decode body (at most "
    f"{_CONTAINER_BOUNDS['max_map_len']} map entries, {_CONTAINER_BOUNDS['max_array_len']} array items, "
    f"{_CONTAINER_BOUNDS['max_str_len']}-char strings)"
)
NOT_MSGPACK = "not msgpack (an invalid first byte or type)"
LOOKS_LIKE_JSON = "it looks like JSON; /decode reads msgpack (vae_service_client.messages.pack)"


class _Malformed(Exception):
    """The walk's refusal; its argument is one of the reasons above."""


def _refused(reason: str, body: bytes | memoryview) -> InvalidInput:
    if bytes(body[:64]).lstrip()[:1] in (b"{", b"["):  # its first 64 bytes only: never a copy of the body
        reason = LOOKS_LIKE_JSON
    return InvalidInput("body", f"is not a msgpack /decode map: {reason}")


def _why(exc: Exception) -> str:
    """msgpack's own errors in the request's terms: its messages name its internals
    (`unpack(b) received extra data`, `StackError`, `max_array_len(12)`), which a caller cannot act on."""
    if isinstance(exc, _Malformed):
        return str(exc)
    if isinstance(exc, msgpack.ExtraData):
        return EXTRA_DATA
    if isinstance(exc, UnicodeDecodeError):
        return NOT_UTF8
    if isinstance(exc, msgpack.StackError):
        return TOO_DEEP
    text = str(exc)
    if "incomplete input" in text:
        return TRUNCATED
    if "exceeds max_" in text:
        return OVER_BOUNDS
    return NOT_MSGPACK


# ---- the one walk ----------------------------------------------------------------------------------
# msgpack's type bytes (https://github.com/msgpack/msgpack/blob/master/spec.md): the size of a
# fixed-size scalar (type byte included); a fixext's data size; the kind and length size of the rest
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
_FIXED |= {0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_SIZED = {0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4), 0xC7: ("ext", 1), 0xC8: ("ext", 2)}
_SIZED |= {0xC9: ("ext", 4), 0xD9: ("str", 1), 0xDA: ("str", 2), 0xDB: ("str", 4)}
_SIZED |= {0xDC: ("array", 2), 0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4)}
_ROUTING_KEYS = ("model", "stream")


class _Walk:
    """One pass over a body's msgpack, reading headers only: every container within its bound and
    the depth, at most MAX_VALUES values, nothing past the end and nothing after the first object;
    strings and extensions (at most a few KiB) checked by msgpack itself, bin data never touched.
    Work: at most MAX_VALUES steps, whatever the body. What it accepts, msgpack.unpackb with
    `unpack_options` parses; it refuses what that refuses (first in byte order, as msgpack does),
    and what it would take seconds or gigabytes to."""

    def __init__(self, body: bytes, max_request_bytes: int):
        self.body, self.pos, self.values = memoryview(body), 0, 0
        self.options = unpack_options(max_request_bytes)
        self.top: dict[str, tuple[str, int, int]] = {}  # routing key -> the (kind, start, end) of its last value

    def whole(self) -> str:
        """Walk the body; the kind of its one object."""
        kind, _, _ = self.value(0)
        if self.pos != len(self.body):
            raise _Malformed(EXTRA_DATA)
        return kind

    def parsed(self, start: int, end: int) -> object:
        return msgpack.unpackb(self.body[start:end], **self.options)

    def take(self, n: int) -> int:
        start = self.pos
        if n > len(self.body) - start:
            raise _Malformed(TRUNCATED)
        self.pos += n
        return start

    def value(self, depth: int) -> tuple[str, int, int]:
        """The value at `pos`, inside `depth` containers: (its kind, start, end)."""
        self.values += 1
        if self.values > MAX_VALUES:
            raise _Malformed(TOO_MANY)
        start = self.pos
        first = self.body[self.take(1)]
        if first <= 0x7F or first >= 0xE0:
            return "int", start, self.pos
        if first <= 0x9F:
            kind, n = ("map" if first <= 0x8F else "array"), first & 0x0F
        elif first <= 0xBF:
            kind, n = "str", first & 0x1F
        elif first in _FIXED:
            self.take(_FIXED[first] - 1)
            return "scalar", start, self.pos
        elif first in _FIXEXT:
            kind, n = "ext", 1 + _FIXEXT[first]  # the ext's type byte, then its data
        elif first in _SIZED:
            kind, size = _SIZED[first]
            at = self.take(size)
            n = int.from_bytes(self.body[at : at + size], "big") + (kind == "ext")
        else:  # 0xC1, never used
            raise _Malformed(NOT_MSGPACK)
        if kind == "map":
            self.container(depth, n, _CONTAINER_BOUNDS["max_map_len"])
            for _ in range(n):
                key_kind, key_start, key_end = self.value(depth + 1)
                entry = self.value(depth + 1)
                if key_kind not in ("str", "bin"):  # msgpack's strict_map_key, checked as it does: after the value
                    raise _Malformed(NOT_MSGPACK)
                if depth == 0 and key_kind == "str" and (key := self.parsed(key_start, key_end)) in _ROUTING_KEYS:
                    self.top[key] = entry
        elif kind == "array":
            self.container(depth, n, _CONTAINER_BOUNDS["max_array_len"])
            for _ in range(n):
                self.value(depth + 1)
        else:
            self.take(n)  # a string's, bin's or ext's data, all there (truncated first, as msgpack says)
            if kind != "bin":  # the data within max_bin_len: the body is (check_body_size)
                self.parsed(start, self.pos)  # over its bound, not UTF-8, an ext: msgpack's own error
        return kind, start, self.pos

    def container(self, depth: int, n: int, bound: int) -> None:
        if depth >= MAX_DEPTH:
            raise _Malformed(TOO_DEEP)
        if n > bound:
            raise _Malformed(OVER_BOUNDS)


def _walked(body: bytes, max_request_bytes: int) -> tuple[_Walk, str]:
    check_body_present(body)
    check_body_size(len(body), max_request_bytes)
    walk = _Walk(body, max_request_bytes)
    try:
        return walk, walk.whole()
    except InvalidInput:  # an extension (the ext_hook)
        raise
    except Exception as exc:  # truncated, extra data, bad utf-8, too deep, over a bound: malformed
        raise _refused(_why(exc), body) from None


def unpack_body(body: bytes, max_request_bytes: int) -> object:
    """The replica's parse: the walk, then msgpack's own (bounded) parser."""
    walk, _ = _walked(body, max_request_bytes)
    try:
        return msgpack.unpackb(body, **walk.options)
    except InvalidInput:
        raise
    except Exception as exc:  # nothing the walk let through; kept so a gap can never be a 500
        raise _refused(_why(exc), body) from None


def peek_routing(body: bytes, max_request_bytes: int) -> tuple[str | None, bool]:
    """The router's peek: the `model` and `stream` keys of a msgpack /decode body, read without
    unpacking the latents, in constant work. A body the replica refuses as a body (malformed, over
    the bounds, not a map) is refused here with the replica's own answer; (None, False) where the
    keys are absent, and `model` None where it is not a string (the replica names the field)."""
    walk, kind = _walked(body, max_request_bytes)
    if kind != "map":  # the replica's own refusal; within the bounds, so parsed in constant work
        request_fields(msgpack.unpackb(body, **walk.options))
    found = {}
    for key, (value_kind, start, end) in walk.top.items():
        found[key] = walk.parsed(start, end) if value_kind in ("str", "int", "scalar") else None
    model = found.get("model")
    return (model if isinstance(model, str) else None), found.get("stream") is True
