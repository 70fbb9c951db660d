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
