"""The decoder actor's class in-process (no Ray cluster): the handle API's answers, its lifecycle
(close drains, releases the folded buffers once, refuses later calls), latents already on the
decoding device kept there (how a compiled graph's GPU-to-GPU hand-over reaches the engine), and a
watched session's viewer in the actor's caller (its `watch` stream)."""

import numpy as np
import pytest
import torch

from tests.models import reference_decode, torch_threads
from tests.session_wire import decoded_video, latents
from vae_service.protocol.requests import request_from_call
from vae_service.ray import Decoder
from vae_service_client import InvalidRequest


@pytest.fixture
def decoder(kl_dir):
    decoder = Decoder({"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1})
    yield decoder
    decoder.close()


def test_decode_answers_like_the_handle_api(decoder, kl_reference):
    z = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(4))
    result = decoder.decode(z, output="float", scaling_factor=None)
    assert (result["model"], result["quality"], result["timing"]["batch_size"]) == ("kl", "lossless", 2)
    with torch_threads(1):
        np.testing.assert_array_equal(result["output"], reference_decode(kl_reference, z).numpy())
    with pytest.raises(InvalidRequest) as err:
        decoder.decode(z, quality="best")
    assert (err.value.status, err.value.field) == (400, "quality")


def test_close_drains_releases_folded_buffers_once_and_refuses_later_calls(decoder):
    decoder.decode(torch.zeros(1, 4, 4, 4), quality="high")
    folded = decoder.describe()["fast_path"]["folded_bytes"]
    assert folded > 0
    decoder.__ray_shutdown__()  # what Ray calls on a graceful exit
    assert decoder.service.engine.fast_path.folded.nbytes == 0
    assert decoder.close() == 0  # already closed
    with pytest.raises(RuntimeError, match="closed"):
        decoder.decode(torch.zeros(1, 4, 4, 4))


def test_latents_on_the_decoding_device_stay_there():
    on_meta = torch.empty(1, 4, 2, 2, device="meta")
    assert request_from_call(on_meta, torch.device("meta")).latents.device.type == "meta"
    assert request_from_call(torch.zeros(1, 4, 2, 2), torch.device("meta")).latents.device.type == "cpu"
    with pytest.raises(NotImplementedError):  # anywhere else, tensors come to the host first
        request_from_call(on_meta)


def test_a_watched_sessions_viewer_gets_its_file_from_the_actor_and_the_denoiser_only_chunk_done(wan_dir):
    decoder = Decoder({"model": str(wan_dir), "cpu_threads": 1, "serving": {"fit_prices_at_start": False}})
    try:
        opened = decoder.open_session(height=6, width=10, output="mp4", frames="none", watch=True)
        session, watch_id, token = opened["session"], opened["watch"]["id"], opened["watch"]["token"]
        refused = next(decoder.watch(watch_id, "A" * 43))
        items = decoder.watch(watch_id, token)
        assert next(items) == {"joined": watch_id, "frame": 0}
        done = [decoder.decode_chunk(session, latents(t, seed), at) for t, seed, at in ((2, 1, 0), (1, 2, 2))]
        decoder.close_session(session)
        rest = list(items)
    finally:
        decoder.close()
    assert refused == {"refused": "unauthenticated"}
    assert [set(d) for d in done] == [{"done"}, {"done"}]  # frames: none
    start, fragments, ended = rest[0]["start"], [r["fragment"] for r in rest[1:-1]], rest[-1]
    assert start["content_type"].startswith("video/mp4") and len(fragments) == 3
    assert ended == {"ended": "closed", "frames": done[-1]["done"]["frames"]}
    data = start["init"] + b"".join(f.data for f in fragments)
    assert len(decoded_video(data)) == done[-1]["done"]["frames"]
