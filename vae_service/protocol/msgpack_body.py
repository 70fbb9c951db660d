"""A `POST /decode` body's bytes, before any field is read: Content-Type, size, msgpack unpacked
within bounds (a hostile body is refused, never walked), and the routing keys peeked at without
unpacking the latents. Fields become a DecodeRequest in protocol/requests.py."""

from __future__ import annotations

import msgpack

from vae_service.engine.errors import InvalidInput, LimitExceeded
from vae_service.protocol.errors import UnsupportedMediaType
from vae_service_client.messages import MSGPACK_TYPES, REQUEST_KEYS
from vae_service_client.tensors import MAX_NDIM


def check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";")[0].strip().lower()
    if media not in MSGPACK_TYPES:
        raise UnsupportedMediaType("Content-Type", f"must be application/msgpack, got {content_type or 'nothing'!r}")


def check_body_size(size: int, max_request_bytes: int) -> None:
    if size > max_request_bytes:
        raise LimitExceeded("body", f"{size} bytes is over the limit of {max_request_bytes} (max_request_bytes)")


def _refuse_ext(code: int, data: bytes) -> None:
    raise InvalidInput("body", f"msgpack extension types are not accepted (ext code {code})")


# A /decode body is one map of at most len(REQUEST_KEYS) keys, a 3-key tensor map and a shape of
# at most MAX_NDIM dims; anything bigger is malformed. Without these bounds a 24 MiB body of
# millions of empty arrays took 3.5 s to parse here; with them it is refused in microseconds
# (nesting deeper than msgpack's stack is refused as fast).
_CONTAINER_BOUNDS = {
    "max_map_len": 2 * len(REQUEST_KEYS),
    "max_array_len": 2 * MAX_NDIM,
    "max_str_len": 1024,
    "max_ext_len": 16,  # the ext_hook refuses every extension, with a message saying so
}


def unpack_body(body: bytes, max_request_bytes: int) -> object:
    check_body_size(len(body), max_request_bytes)
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            ext_hook=_refuse_ext,
            strict_map_key=True,
            max_bin_len=max_request_bytes,
            **_CONTAINER_BOUNDS,
        )
    except InvalidInput:
        raise
    except Exception as exc:  # truncated, extra data, bad utf-8, over-deep nesting, over a bound: malformed
        raise InvalidInput("body", f"is not a msgpack /decode map: {_why(exc, body)}") from None


def _why(exc: Exception, body: bytes) -> str:
    """What was wrong, in the request's terms: msgpack's own messages name its internals
    (`unpack(b) received extra data`, `StackError`, `max_array_len(12)`), which a caller cannot act on."""
    if body.lstrip()[:1] in (b"{", b"["):
        return "it looks like JSON; /decode reads msgpack (vae_service_client.messages.pack)"
    if isinstance(exc, msgpack.ExtraData):
        return "bytes follow the first msgpack object (send one map, Content-Type application/msgpack)"
    if isinstance(exc, UnicodeDecodeError):
        return "a string is not UTF-8 (binary data goes in msgpack bin, not str)"
    if isinstance(exc, msgpack.StackError):
        return "nested deeper than a /decode body ever is"
    text = str(exc)
    if "incomplete input" in text:
        return "it ends early (truncated)"
    if "exceeds max_" in text:
        return (
            f"a map, array or string is over the bounds of a /decode body (at most "
            f"{_CONTAINER_BOUNDS['max_map_len']} map entries, {_CONTAINER_BOUNDS['max_array_len']} array items, "
            f"{_CONTAINER_BOUNDS['max_str_len']}-char strings)"
        )
    return "not msgpack (an invalid first byte or type)"


def peek_routing(body: bytes) -> tuple[str | None, bool]:
    """The `model` and `stream` keys of a msgpack /decode body, read without unpacking the latents
    (routing). (None, False) where absent or malformed: the decoder then answers the precise 400."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(body)
    found: dict = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in ("model", "stream"):
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # malformed: not the router's to judge
        return None, False
    model = found.get("model")
    return (model if isinstance(model, str) else None), found.get("stream") is True
