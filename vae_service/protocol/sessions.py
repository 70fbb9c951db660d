"""Decode sessions on the wire -> the engine's types and back: the open message's settings, a chunk's
latents as a DecodeRequest, and the answers (opened, a chunk's frames or fragments, chunk_done,
closed) as the maps a WebSocket or a handle carries. The messages are documented in
docs/interfaces.md ("Decode sessions"); every body is parsed by the bounded msgpack walk."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from vae_service.engine.request.decode_request import VIDEO_OUTPUTS, DecodeRequest
from vae_service.engine.request.errors import InvalidInput, LimitExceeded
from vae_service.engine.request.session import SessionOpen
from vae_service.protocol.errors import WireErrorInfo
from vae_service.protocol.msgpack_body import unpack_body
from vae_service.protocol.requests import engine_fields
from vae_service.protocol.responses import TRAILERS
from vae_service.protocol.tensors import to_numpy, to_torch
from vae_service_client.errors import did_you_mean
from vae_service_client.frames import frames_message
from vae_service_client.messages import LATENT_DTYPES, decode_tensor
from vae_service_client.mp4 import DONE_TAG

OPEN_KEYS = (
    "height",
    "width",
    "quality",
    "output",
    "dtype",
    "scaling_factor",
    "shift_factor",
    "model",
    "request_id",
    "clip_latent_frames",
    "priority",  # the scheduler's class for the session's chunks (names.PRIORITIES); absent: the deployment's default
    "frames",  # what the caller gets back: "all" (default) or "none" (only each chunk's chunk_done)
    "watch",  # true: viewers may watch it (opened.watch carries their token)
)
DELIVERY_KEYS = ("frames", "watch")
FRAMES_BACK = ("all", "none")
CHUNK_KEYS = ("latents", "latent_frame")
MESSAGES = ("open", "attach", "chunk", "close")
ATTACH_KEYS = ("session", "latent_frames")
MAX_OPEN_BYTES = 64 * 1024  # an open's fields are a few short strings and numbers
MAX_SESSION_ID_CHARS = 256  # a replica id and a uuid


def _known(fields: object, allowed: tuple[str, ...], what: str) -> dict:
    if not isinstance(fields, dict):
        raise InvalidInput(what, f"must be a map, got {type(fields).__name__}")
    unknown = sorted(k if isinstance(k, str) else repr(k) for k in fields if k not in allowed)
    if unknown:
        raise InvalidInput(unknown[0], f"unknown key{did_you_mean(unknown[0], allowed)} (allowed: {list(allowed)})")
    return fields


def session_open(fields: object) -> SessionOpen:
    """An `open` message's map (or a handle's keyword arguments) -> SessionOpen; the factors' three
    states as /decode's (protocol/requests.py's engine_fields)."""
    fields = _known(fields, OPEN_KEYS, "open")
    for key in ("height", "width"):
        if key not in fields:
            raise InvalidInput(key, "is required: the latents' size of every chunk")
    return SessionOpen(**engine_fields({k: v for k, v in fields.items() if k not in DELIVERY_KEYS}))


@dataclass(frozen=True)
class Delivery:
    """Where a session's frames go: back to its caller (`frames_back`), to viewers (`watch`), or both."""

    frames_back: bool = True
    watch: bool = False


def session_delivery(fields: dict, output: str) -> Delivery:
    """An open's `frames` and `watch` (checked after session_open, which knows the keys)."""
    frames = fields.get("frames", "all")
    if frames not in FRAMES_BACK:
        raise InvalidInput("frames", f"what the caller gets back: one of {list(FRAMES_BACK)}, got {frames!r}")
    watch = fields.get("watch", False)
    if not isinstance(watch, bool):
        raise InvalidInput("watch", f"true or false, got {watch!r}")
    if watch and output not in VIDEO_OUTPUTS:
        raise InvalidInput(
            "watch",
            f"a watched session's output is mp4 or webm (its viewers get the session's own file), not {output!r}",
        )
    return Delivery(frames_back=frames == "all", watch=watch)


def session_attach(fields: object) -> tuple[str, int | None]:
    """An `attach` message's map -> (the session's id, the latent frames the client has received,
    or None): a client continuing a session that moved to another replica (or resuming one from
    its checkpoint after its replica was lost)."""
    fields = _known(fields, ATTACH_KEYS, "attach")
    session = fields.get("session")
    if not isinstance(session, str) or not session or len(session) > MAX_SESSION_ID_CHARS:
        raise InvalidInput("session", f"the session's id: a string of at most {MAX_SESSION_ID_CHARS} characters")
    return session, _latent_frame(fields.get("latent_frames"), "latent_frames")


def parse_message(body: bytes, max_request_bytes: int) -> tuple[str, dict]:
    """One WebSocket message: (its kind, its map), bounded like a /decode body. A message over the
    bound is a chunk's latents (nothing else a session sends comes near it): 413 naming `latents`,
    and the session goes on."""
    if len(body) > max_request_bytes:
        raise LimitExceeded(
            "latents",
            f"a message of {len(body)} bytes is over the limit of {max_request_bytes} (max_request_bytes): "
            "send fewer latent frames per chunk",
        )
    try:
        message = unpack_body(body, max_request_bytes)
    except InvalidInput as refused:  # the walk bounds a /decode body: an open is read by its own bounds
        message = _open_message(body)
        if message is None:
            raise refused from None
    if not isinstance(message, dict) or len(message) != 1:
        raise InvalidInput("message", f"one map with one of the keys {list(MESSAGES)}")
    ((kind, fields),) = message.items()
    if kind not in MESSAGES:
        hint = did_you_mean(kind, MESSAGES)
        raise InvalidInput("message", f"unknown message {kind!r}{hint} (allowed: {list(MESSAGES)})")
    return kind, fields if fields is not None else {}


def _open_message(body: bytes) -> dict | None:
    """An `open` message the /decode walk refused (a string over its 1024 characters: a 5,000-char
    `request_id`) read by msgpack's own parser under an open's bounds (a few KiB, small containers),
    so that session_open names the field; None for anything else (the walk's refusal stands)."""
    if len(body) > MAX_OPEN_BYTES:
        return None
    bounds = {"max_str_len": len(body), "max_bin_len": len(body), "max_array_len": 16, "max_map_len": 32}
    try:
        message = msgpack.unpackb(body, raw=False, max_ext_len=0, **bounds)
    except Exception:  # malformed, an extension, over the bounds: the walk's answer
        return None
    return message if isinstance(message, dict) and list(message) == ["open"] else None


def chunk_request(fields: object, settings: SessionOpen) -> tuple[DecodeRequest, int | None]:
    """A `chunk` message's map -> (its latents as a request with the session's settings, the
    `latent_frame` it says it starts at)."""
    fields = _known(fields, CHUNK_KEYS, "chunk")
    if "latents" not in fields:
        raise InvalidInput("latents", "is required")
    shape = fields["latents"].get("shape") if isinstance(fields["latents"], dict) else None
    if isinstance(shape, list | tuple) and all(type(d) is int for d in shape):
        _refuse_empty(shape)
    latents = to_torch(decode_tensor(fields["latents"], "latents", LATENT_DTYPES))
    return chunk_of(latents, settings), _latent_frame(fields.get("latent_frame"))


def chunk_of(latents, settings: SessionOpen) -> DecodeRequest:
    """A chunk's latents (a torch tensor on the host or the decoding device) as a request carrying
    the session's factors."""
    shape = getattr(latents, "shape", None)
    if shape is not None:
        _refuse_empty(list(shape))
    factors = {k: getattr(settings, k) for k in ("scaling_factor", "shift_factor") if getattr(settings, k) is not None}
    return DecodeRequest(latents, quality=settings.quality, latents_scaled=settings.latents_scaled, **factors)


def _refuse_empty(shape: list) -> None:
    """A chunk [1, C, t, H, W] with t = 0 (or any other empty axis): nothing to decode, said so."""
    if len(shape) == 5 and 0 in shape:
        raise InvalidInput(
            "latents",
            f"an empty chunk, shape {list(shape)}: a chunk is [1, C, t, H, W] with t >= 1 latent frames "
            "(and no empty axis)",
        )


def _latent_frame(value: object, field: str = "latent_frame") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = "the chunk's first latent frame" if field == "latent_frame" else "latent frames received"
        raise InvalidInput(field, f"{what}: an integer >= 0, got {value!r}")
    return value


def attached_message(summary: dict, kind: str) -> dict:
    """The answer to `attach`: the session's summary where it continues (`latent_frames`, `frames`:
    where it stands; `from`: `handoff` when it is as the client left it, `checkpoint` when the
    client must resend its chunks from `latent_frames`)."""
    return {"attached": {**summary, "from": kind}}


def moved_message(session_id: str) -> dict:
    """The session left this replica (it drains): reconnect and `attach` to it."""
    return {"moved": {"session": session_id}}


def opened_message(summary: dict) -> dict:
    return {"opened": summary}


def closed_message(summary: dict, output: str) -> dict:
    """The answer to `close`; an mp4/webm session's also carries the file's closing box (element),
    `trailer`, holding the summary as a streamed /decode answer's does: appended after the
    fragments, the file ends as a streamed answer ends."""
    if output in TRAILERS:
        return {"closed": {**summary, "trailer": TRAILERS[output](DONE_TAG, summary)}}
    return {"closed": summary}


def frames_of(chunk, wire: bool = True) -> dict:
    """A chunk's frames as the /decode stream's frame message (`wire`: the tensor map; else numpy)."""
    if wire:
        return frames_message(0, chunk.frame, chunk.pixels)
    return {"item": 0, "frame": chunk.frame, "pixels": to_numpy(chunk.pixels)}


def fragment_message(fragment) -> dict:
    return {"frame": fragment.frame, "frames": fragment.frames, "fragment": fragment.data}


def error_message(info: WireErrorInfo, **extra) -> dict:
    return {
        "error": {
            "type": info.type,
            "field": info.field,
            "message": info.message,
            "retry_after": info.retry_after_s,
            **extra,
        }
    }
