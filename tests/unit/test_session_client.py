"""The session client's own part (vae_service_client/sessions.py), no server: what it refuses before
sending anything (naming the field), the URL it connects to, how a whole latent is cut into chunks,
and what a resume's replay keeps of frames and fragments the caller already has. The client against
the real service (sync, async, resume after a killed replica, expiry, the CLI): the integration
tests/integration/test_sessions.py."""

import numpy as np
import pytest

from vae_service_client import InvalidRequest, VaeClient
from vae_service_client.sessions import (
    SessionBook,
    chunk_fields,
    chunks_of,
    new_fragments,
    open_fields,
    trim_pixels,
    ws_url,
)


@pytest.mark.parametrize(
    "base, url",
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/sessions"),
        ("https://decode.example.com/wan/", "wss://decode.example.com/wan/sessions"),
    ],
)
def test_the_socket_is_beside_the_clients_base_url(base, url):
    assert ws_url(base) == url


@pytest.mark.parametrize(
    "args, options, field",
    [
        ((0, 8), {}, "height"),
        ((8, True), {}, "width"),
        ((8, 8, "lossless", "png"), {}, "output"),
        ((8, 8, "lossless", "uint8", "float64"), {}, "dtype"),
        ((8, 8), {"scaling": 0.5}, "scaling"),
    ],
)
def test_bad_settings_are_refused_before_connecting_naming_the_field(args, options, field):
    with pytest.raises(InvalidRequest) as err:
        open_fields(*args, **options)
    assert err.value.field == field and err.value.status == 400


def test_a_session_opened_against_nothing_is_unreachable_not_a_hang():
    from vae_service_client import ServiceUnreachable

    with pytest.raises(ServiceUnreachable, match="connection refused"):
        VaeClient("http://127.0.0.1:9", timeout=5, retries=0).session(4, 4)


def test_the_open_message_carries_only_what_was_given():
    fields = open_fields(6, 10, "high", "mp4", "float16", scaling_factor=None, model="wan", clip_latent_frames=21)
    assert fields == {"height": 6, "width": 10, "quality": "high", "output": "mp4", "dtype": "float16",
                      "scaling_factor": None, "model": "wan", "clip_latent_frames": 21}  # fmt: skip
    assert "scaling_factor" not in open_fields(6, 10)  # unset: the model's own


@pytest.mark.parametrize(
    "shape, dtype, field",
    [
        ((1, 4, 6, 10), "float32", "latents.shape"),  # an image's: the time axis lost
        ((2, 4, 1, 6, 10), "float32", "latents.shape"),
        ((1, 4, 1, 6, 11), "float32", "latents.shape"),
        ((1, 4, 1, 6, 10), "float16", "latents.dtype"),
    ],
)
def test_a_chunk_other_than_the_sessions_is_refused_before_sending(shape, dtype, field):
    settings = open_fields(6, 10)
    with pytest.raises(InvalidRequest) as err:
        chunk_fields(np.zeros(shape, dtype), 0, settings)
    assert err.value.field == field


@pytest.mark.parametrize("frames, per_chunk", [(7, 1), (7, 3), (7, 7), (7, 10), (1, 2)])
def test_chunks_of_cut_a_clip_into_consecutive_views(frames, per_chunk):
    z = np.arange(frames * 4 * 6, dtype=np.float32).reshape(1, 4, frames, 2, 3)
    parts = list(chunks_of(z, per_chunk))
    assert [p.shape[2] for p in parts] == [min(per_chunk, frames - a) for a in range(0, frames, per_chunk)]
    assert all(np.shares_memory(p, z) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts, axis=2), z)
    with pytest.raises(InvalidRequest, match="chunks"):
        list(chunks_of(z, 0))


@pytest.mark.parametrize("dtype, axis", [(np.uint8, 1), (np.float32, 2)])
def test_a_replays_frames_the_caller_has_are_not_handed_out_again(dtype, axis):
    shape = [1, 5, 2, 2, 3] if axis == 1 else [1, 3, 5, 2, 2]
    pixels = np.arange(np.prod(shape)).reshape(shape).astype(dtype)
    assert trim_pixels(4, pixels, seen=0)[0] == 4 and trim_pixels(4, pixels, seen=4)[1].shape == pixels.shape
    frame, kept = trim_pixels(4, pixels, seen=6)  # frames 4, 5 handed out already
    assert frame == 6
    np.testing.assert_array_equal(kept, pixels.take(range(2, 5), axis=axis))
    assert trim_pixels(4, pixels, seen=9) is None
    fragments = [{"frame": 0, "frames": 1}, {"frame": 1, "frames": 4}, {"frame": 5, "frames": 4}]
    assert new_fragments(fragments, 5) == fragments[2:]


def test_a_file_is_written_only_for_video_sessions(tmp_path):
    with pytest.raises(InvalidRequest) as err:
        SessionBook(open_fields(6, 10, output="uint8"), path=tmp_path / "x.mp4")
    assert err.value.field == "path"


# ---- gRPC (DecodeSession): the same messages in protobuf, both ways ------------------------------
OPENS = [
    open_fields(6, 10),
    open_fields(6, 10, "high", "webm", "bfloat16", scaling_factor=None, shift_factor=None, model="wan"),
    open_fields(6, 10, output="float", scaling_factor=0.5, shift_factor=0.0, request_id="r1", clip_latent_frames=21),
]


@pytest.mark.parametrize("fields", OPENS, ids=range(len(OPENS)))
def test_an_open_crosses_grpc_as_the_server_reads_a_websockets_open(fields):
    """The client's open map -> SessionRequest -> the map the server reads: the same settings (the
    defaults the client fills in kept, an explicit zero factor kept, nil factors = already scaled)."""
    from vae_service.protocol.sessions import session_open
    from vae_service_client.session_proto import request_map, request_proto

    msg = request_proto({"open": fields})
    kind, read = request_map(type(msg).FromString(msg.SerializeToString()))
    assert kind == "open" and read == fields
    assert session_open(read) == session_open(fields)


def test_a_chunk_and_a_close_cross_grpc_unchanged():
    from vae_service_client.messages import latents_map
    from vae_service_client.session_proto import request_map, request_proto

    z = np.random.default_rng(0).standard_normal((1, 4, 2, 6, 10)).astype(np.float16)
    for latent_frame in (0, 7):
        fields = chunk_fields(z, latent_frame, open_fields(6, 10, dtype="float16"))
        kind, read = request_map(request_proto({"chunk": fields}))
        assert kind == "chunk" and read["latent_frame"] == latent_frame
        assert read["latents"] == {**latents_map(z), "data": bytes(latents_map(z)["data"])}
    assert request_map(request_proto({"close": {}})) == ("close", {})
    for attach in ({"session": "r.1", "latent_frames": 0}, {"session": "r.2", "latent_frames": 9}, {"session": "r.3"}):
        assert request_map(request_proto({"attach": attach})) == ("attach", attach)
    from vae_service_client.grpc_gen import decode_pb2

    assert request_map(decode_pb2.SessionRequest()) == (None, {})
    assert request_map(decode_pb2.SessionRequest(chunk=decode_pb2.SessionChunk())) == ("chunk", {})


def reply_maps():
    """The server's answers, built by its own functions (protocol/sessions.py)."""
    import torch

    from vae_service.engine.execution.session import ChunkFrames
    from vae_service.protocol.errors import WireErrorInfo
    from vae_service.protocol.sessions import (
        attached_message,
        closed_message,
        error_message,
        fragment_message,
        frames_of,
        moved_message,
        opened_message,
    )
    from vae_service_client.mp4 import Mp4Fragment

    pixels = torch.arange(2 * 3 * 4 * 3, dtype=torch.uint8).reshape(1, 2, 3, 4, 3)
    opened = {
        "session": "abc.1", "model": "wan", "quality": "lossless", "precision": "fp32", "output": "uint8",
        "held_bytes": 12345, "idle_timeout_s": 30.0, "max_chunk_latent_frames": 8, "latent_channels": 16,
        "spatial_scale": 8,
    }  # fmt: skip
    done = {"latent_frame": 2, "latent_frames": 3, "frames": 9, "precision": "fp16", "checkpointed_latent_frames": 2,
            "timing": {"queue_ms": 1.5, "decode_ms": 20.25, "encode_ms": 0.0, "batch_size": 2,
                       "preempted_ms": 3.5}}  # fmt: skip
    where = {"latent_frames": 7, "frames": 25, "checkpointed_latent_frames": 4}
    error = WireErrorInfo("invalid_request", "latents.shape", "no", None)
    overloaded = WireErrorInfo("overloaded", "session", "full", 2.0)
    return [
        opened_message({**opened, "request_id": None}),
        opened_message({**opened, "request_id": "r1"}),
        attached_message({**opened, **where, "request_id": None}, "handoff"),
        attached_message({**opened, **where, "request_id": "r1"}, "checkpoint"),
        moved_message("abc.1"),
        frames_of(ChunkFrames(pixels, 5, 2, "fp32", 1.0, 1)),
        fragment_message(Mp4Fragment(5, 4, b"\x00\x01moof")),
        {"chunk_done": done},
        {"chunk_done": {**done, "fallback_from_frame": 5}},
        closed_message({"frames": 9, "latent_frames": 3}, "uint8"),
        closed_message({"frames": 9, "latent_frames": 3}, "mp4"),
        error_message(error, frames=9),
        error_message(overloaded),
    ]


def test_every_reply_crosses_grpc_as_the_websocket_carries_it():
    """Each answer map -> SessionReply (bytes on the wire) -> the map the client reads: equal, so the
    session's bookkeeping cannot tell the transports apart."""
    from vae_service_client.session_proto import reply_map, reply_proto

    for message in reply_maps():
        msg = reply_proto(message)
        read = reply_map(type(msg).FromString(msg.SerializeToString()))
        expected = dict(message)
        if "pixels" in message:
            expected["pixels"] = {**message["pixels"], "data": bytes(message["pixels"]["data"])}
        assert read == expected, message
