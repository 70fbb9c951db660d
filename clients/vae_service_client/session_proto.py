"""Decode sessions over gRPC (VaeDecoder.DecodeSession): the WebSocket messages' maps (sessions.py)
as their protobuf messages and back, so a session has one contract whatever carries it. The server
reads requests with `request_map` and writes replies with `reply_proto`; the client the other way.
proto3 zero values are absent ("" for a string, 0 for a count, false for `watch`); `latents_scaled`
is both factors nil, as in DecodeRequest (messages.py). An opened (attached) session's `watch` map is
SessionOpened.watch, set only for a watched session."""

from __future__ import annotations

from vae_service_client.errors import refused_here
from vae_service_client.grpc_gen import decode_pb2
from vae_service_client.messages import tensor_map_of_proto, tensor_proto, timing_of_proto, timing_proto

FACTORS = ("scaling_factor", "shift_factor")
OPEN_TEXT = ("quality", "output", "dtype", "model", "request_id", "priority", "frames")
OPENED_KEYS = (
    "session",
    "model",
    "quality",
    "precision",
    "output",
    "held_bytes",
    "idle_timeout_s",
    "max_chunk_latent_frames",
    "latent_channels",
    "spatial_scale",
)
ATTACHED_KEYS = ("from", "latent_frames", "frames", "checkpointed_latent_frames")
WATCH_KEYS = ("id", "token", "url")


# ---- requests: client -> server ------------------------------------------------------------------
def request_proto(message: dict):
    """`{"open": map}`, `{"chunk": {latents, latent_frame}}` or `{"close": {}}` as a SessionRequest."""
    ((kind, fields),) = message.items()
    if kind == "close":
        return decode_pb2.SessionRequest(close=decode_pb2.SessionClose())
    if kind == "attach":
        attach = decode_pb2.SessionAttach(session=fields["session"])
        if fields.get("latent_frames") is not None:
            attach.latent_frames = fields["latent_frames"]
        return decode_pb2.SessionRequest(attach=attach)
    if kind == "chunk":
        chunk = decode_pb2.SessionChunk(latents=tensor_proto(encoded=fields["latents"]))
        if fields.get("latent_frame") is not None:
            chunk.latent_frame = fields["latent_frame"]
        return decode_pb2.SessionRequest(chunk=chunk)
    fields = dict(fields)
    opened = decode_pb2.SessionOpen()
    for key in FACTORS:
        if key in fields and fields[key] is None:
            opened.latents_scaled = True
            del fields[key]
    for key, value in fields.items():
        try:
            setattr(opened, key, value)
        except (TypeError, ValueError) as exc:  # out of int32, another type: nothing sent
            raise refused_here(key, f"{value!r:.60} does not fit SessionOpen.{key} ({exc})") from None
    return decode_pb2.SessionRequest(open=opened)


def request_map(msg) -> tuple[str, dict]:
    """A SessionRequest as (kind, map), as the WebSocket's message parses; latents as a tensor map.
    An empty message's kind is None (the server refuses it, naming `message`)."""
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        chunk, fields = msg.chunk, {}
        if chunk.HasField("latents"):
            fields["latents"] = tensor_map_of_proto(chunk.latents)
        if chunk.HasField("latent_frame"):
            fields["latent_frame"] = chunk.latent_frame
        return kind, fields
    if kind == "attach":
        attach = msg.attach
        fields = {"session": attach.session}
        if attach.HasField("latent_frames"):
            fields["latent_frames"] = attach.latent_frames
        return kind, fields
    if kind != "open":
        return kind, {}
    opened, fields = msg.open, {}
    for key in ("height", "width", "clip_latent_frames"):
        if getattr(opened, key):
            fields[key] = getattr(opened, key)
    for key in OPEN_TEXT:
        if getattr(opened, key):
            fields[key] = getattr(opened, key)
    if opened.watch:
        fields["watch"] = True
    if opened.latents_scaled:
        fields["scaling_factor"] = fields["shift_factor"] = None
    for key in FACTORS:
        if opened.HasField(key):
            fields[key] = getattr(opened, key)
    return kind, fields


# ---- replies: server -> client --------------------------------------------------------------------
def reply_proto(message: dict):
    """A session's answer map (opened, a frame or fragment message, chunk_done, closed, error) as a
    SessionReply."""
    if "fragment" in message:
        frames = decode_pb2.FrameChunk(
            frame_start=message["frame"], fragment=message["fragment"], frames=message["frames"]
        )
        return decode_pb2.SessionReply(frames=frames)
    if "pixels" in message:
        pixels = message["pixels"]
        tensor = tensor_proto(encoded=pixels) if isinstance(pixels, dict) else tensor_proto(pixels)
        return decode_pb2.SessionReply(frames=decode_pb2.FrameChunk(frame_start=message["frame"], tensor=tensor))
    ((kind, fields),) = message.items()
    if kind in ("opened", "attached"):
        opened = decode_pb2.SessionOpened(
            **{k: fields[k] for k in OPENED_KEYS}, request_id=fields.get("request_id") or ""
        )
        if fields.get("watch"):
            opened.watch.CopyFrom(decode_pb2.WatchInfo(**{k: fields["watch"][k] for k in WATCH_KEYS}))
        if kind == "opened":
            return decode_pb2.SessionReply(opened=opened)
        for key in ATTACHED_KEYS:
            setattr(opened, key, fields[key])
        return decode_pb2.SessionReply(attached=opened)
    if kind == "moved":
        return decode_pb2.SessionReply(moved=decode_pb2.SessionMovedOn(session=fields["session"]))
    if kind == "chunk_done":
        done = decode_pb2.ChunkDone(
            latent_frame=fields["latent_frame"],
            latent_frames=fields["latent_frames"],
            frames=fields["frames"],
            precision=fields["precision"],
            timing=timing_proto(fields["timing"]),
            checkpointed_latent_frames=fields.get("checkpointed_latent_frames", 0),
        )
        if fields.get("fallback_from_frame") is not None:
            done.fallback_from_frame = fields["fallback_from_frame"]
        return decode_pb2.SessionReply(chunk_done=done)
    if kind == "closed":
        closed = decode_pb2.SessionClosed(
            frames=fields["frames"], latent_frames=fields["latent_frames"], trailer=fields.get("trailer", b"")
        )
        return decode_pb2.SessionReply(closed=closed)
    error = decode_pb2.SessionError(type=fields["type"], field=fields.get("field") or "", message=fields["message"])
    for key, name in (("retry_after", "retry_after_s"), ("frames", "frames"), ("latent_frames", "latent_frames")):
        if fields.get(key) is not None:
            setattr(error, name, fields[key])
    return decode_pb2.SessionReply(error=error)


def reply_map(msg) -> dict | None:
    """A SessionReply as the WebSocket's message map (sessions.py reads it); None for the empty
    message that carries a failed stream's status."""
    kind = msg.WhichOneof("kind")
    if kind == "frames":
        chunk = msg.frames
        if chunk.HasField("tensor"):
            return {"item": 0, "frame": chunk.frame_start, "pixels": tensor_map_of_proto(chunk.tensor)}
        return {"frame": chunk.frame_start, "frames": chunk.frames, "fragment": chunk.fragment}
    if kind in ("opened", "attached"):
        opened = getattr(msg, kind)
        fields = {**{k: getattr(opened, k) for k in OPENED_KEYS}, "request_id": opened.request_id or None}
        if kind == "attached":
            fields.update({k: getattr(opened, k) for k in ATTACHED_KEYS})
        if opened.HasField("watch"):
            fields["watch"] = {k: getattr(opened.watch, k) for k in WATCH_KEYS}
        return {kind: fields}
    if kind == "moved":
        return {"moved": {"session": msg.moved.session}}
    if kind == "chunk_done":
        done = msg.chunk_done
        keys = ("latent_frame", "latent_frames", "frames", "precision", "checkpointed_latent_frames")
        fields = {k: getattr(done, k) for k in keys}
        timing = timing_of_proto(done.timing)
        fields["timing"] = {k: timing[k] for k in ("queue_ms", "decode_ms", "encode_ms", "batch_size", "preempted_ms")}
        if done.HasField("fallback_from_frame"):
            fields["fallback_from_frame"] = done.fallback_from_frame
        return {"chunk_done": fields}
    if kind == "closed":
        closed = msg.closed
        fields = {"frames": closed.frames, "latent_frames": closed.latent_frames}
        return {"closed": {**fields, "trailer": closed.trailer} if closed.trailer else fields}
    if kind == "error":
        error = msg.error
        fields = {"type": error.type, "field": error.field or None, "message": error.message}
        fields["retry_after"] = error.retry_after_s if error.HasField("retry_after_s") else None
        for key in ("frames", "latent_frames"):
            if error.HasField(key):
                fields[key] = getattr(error, key)
        return {"error": fields}
    return None
