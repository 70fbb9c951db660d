"""A real replica answers a sub-decode (a tile of another replica's request) only for the
fingerprint its own engine has: one sent by a replica of other weights, precision or CPU thread
count is refused, so its tile is decoded by the request's replica (tests/unit/test_request_context.py
blends such refusals bit for bit); one with no time left is refused too."""

import pytest
import torch

from tests.models import torch_threads
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def replica(ray_cluster, kl_dir):
    from ray import serve

    from tests.integration.conftest import TEST_DEPLOYMENT
    from vae_service.serving.app import decoder_deployment

    config = {"model": str(kl_dir), "model_name": "fingerprint", "cpu_threads": 1}
    serve.run(decoder_deployment(config, **TEST_DEPLOYMENT), name="fingerprint", route_prefix=None)
    yield serve.get_app_handle("fingerprint"), config
    serve.delete("fingerprint")


@pytest.mark.parametrize(
    "other",
    [{"decode_precision": "bf16"}, {"cpu_threads": 2}, {"fast_path": {"disable": ["upsample_fold"]}}],
)
def test_a_replica_refuses_a_tile_from_an_engine_that_decodes_other_bits(replica, kl_dir, other):
    handle, config = replica
    same = DecodeEngine(ServiceConfig(**{**config, "device": "cpu"}))
    differing = DecodeEngine(ServiceConfig(**{**config, "device": "cpu", **other}))
    tile = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    accepted = handle.decode_tile.remote(tile, "high", same.fingerprint, 30.0).result()
    refused = handle.decode_tile.remote(tile, "high", differing.fingerprint, 30.0).result()
    late = handle.decode_tile.remote(tile, "high", same.fingerprint, 0.0).result()
    with torch_threads(1):
        here = same.decode_tile(tile, "high", same.fingerprint)
    assert accepted.refused is None and torch.equal(accepted.pixels, here)  # the same bits anywhere
    assert refused.pixels is None and "decodes as" in refused.refused
    assert late.pixels is None and "deadline" in late.refused


def test_a_video_tile_stream_is_refused_in_one_message(ray_cluster, wan_dir):
    from ray import serve

    from tests.integration.conftest import TEST_DEPLOYMENT
    from vae_service.serving.app import decoder_deployment

    config = {"model": str(wan_dir), "model_name": "fingerprint-wan", "cpu_threads": 1}
    serve.run(decoder_deployment(config, **TEST_DEPLOYMENT), name="fingerprint-wan", route_prefix=None)
    try:
        handle = serve.get_app_handle("fingerprint-wan").options(stream=True)
        tile = torch.randn(1, 4, 2, 8, 8)
        refused = list(handle.decode_tile_chunks.remote(tile, "high", None, "0" * 16, 30.0))
        same = DecodeEngine(ServiceConfig(**{**config, "device": "cpu"}))
        chunks = list(handle.decode_tile_chunks.remote(tile, "high", None, same.fingerprint, 30.0))
    finally:
        serve.delete("fingerprint-wan")
    assert len(refused) == 1 and refused[0].pixels is None and refused[0].refused
    assert len(chunks) == 2 and all(c.refused is None and c.pixels is not None for c in chunks)
