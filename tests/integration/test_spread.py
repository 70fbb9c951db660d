"""One request across replicas (engine/execution/tile_executor.py, serving/scheduling/tile_peers.py)
on a real local Serve:
a tiled `high` image or Wan clip whose tiles went to both replicas of its deployment is
bit-identical to the same plan decoded by one engine (the clip also streamed, its tiles' chunks in
lockstep), says so in `timing.replicas`, and `lossless` above the bound answers diffusers' own tiled
decode."""

import numpy as np
import pytest
import torch

from tests.models import load_reference, torch_threads
from tests.peers import here_only
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service_client import VaeClient
from vae_service_client.frames import assemble

pytestmark = pytest.mark.integration

SPREAD = {"tiles_across_replicas": True, "min_output_pixels": 48 * 48}  # 64x64-pixel tiles of 8 latent px
TWO_REPLICAS = {"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2}
# one tiny-kl deployment of two replicas for both image claims: `high` tiles spread from 48x48
# output pixels, `lossless` above a 16 MiB bound decoded by the model's own tiled decode (its tiles
# spread too; `min_output_pixels` is for `high` only). The bound: the 1x40x36 clip's whole decode is
# over it (priced here: over 24 MiB), its diffusers tiles (3.9 MiB) and the 2x24x26 `high` request's
# tiles within it (at 4 MiB those do not fit: 413). The one-replica engine below gets the same.
KL_SPREAD = {"model_name": "spread", "cpu_threads": 1, "parallel": SPREAD, "limits": {"max_decode_bytes": 16 * 2**20}}


@pytest.fixture
def wan_spread_url(ray_cluster, wan_dir):
    """Deleted after its test (and before the image pair below is deployed: this module's tests run
    in file order): two more replicas would leave the shared cluster short of CPUs."""
    from ray import serve

    from tests.integration.conftest import TEST_DEPLOYMENT
    from vae_service.serving.app import decoder_app

    config = {"model": str(wan_dir), "model_name": "wan-spread", "cpu_threads": 1, "parallel": SPREAD}
    app = decoder_app(config, autoscaling_config=TWO_REPLICAS, **TEST_DEPLOYMENT)
    serve.run(app, name="wan-spread", route_prefix="/wan-spread")
    yield f"{ray_cluster}/wan-spread"
    serve.delete("wan-spread")


def test_wan_tiles_decoded_by_two_replicas_stream_the_one_replica_plan_bit_for_bit(wan_spread_url, wan_dir):
    z = torch.randn(1, 4, 3, 14, 12, generator=torch.Generator().manual_seed(23))  # 4 tiles, 3 latent frames
    engine = DecodeEngine(
        ServiceConfig(model=str(wan_dir), model_name="wan-spread", device="cpu", cpu_threads=1, parallel=SPREAD)
    )
    for output in ("float", "uint8"):
        with VaeClient(wan_spread_url) as client:
            whole = client.decode(z, quality="high", output=output, scaling_factor=None)
            stream = client.decode_frames(z, quality="high", output=output, scaling_factor=None)
            chunks = list(stream)
        with torch_threads(1):
            request = DecodeRequest(z, quality="high", output=output, latents_scaled=True)
            (one,) = engine.decode([here_only(engine.prepare(request))])
        assert whole.tiled and whole.timing["replicas"] == 2
        assert np.array_equal(whole.output, one.output.numpy())
        assert [c.frame for c in chunks] == [0, 1, 5]  # chunk by chunk, each once every tile's arrived
        assert stream.summary.tiled and stream.summary.timing["replicas"] == 2
        assert np.array_equal(assemble(chunks), one.output.numpy())


@pytest.fixture(scope="module")
def spread_url(ray_cluster, kl_dir):
    from ray import serve

    from tests.integration.conftest import TEST_DEPLOYMENT
    from vae_service.serving.app import decoder_app

    app = decoder_app({"model": str(kl_dir), **KL_SPREAD}, autoscaling_config=TWO_REPLICAS, **TEST_DEPLOYMENT)
    serve.run(app, name="spread", route_prefix="/spread")
    yield f"{ray_cluster}/spread"
    serve.delete("spread")


def test_tiles_decoded_by_two_replicas_are_the_one_replica_plan_bit_for_bit(spread_url, kl_dir):
    z = torch.randn(2, 4, 24, 26, generator=torch.Generator().manual_seed(21))  # 16 tiles per item
    with VaeClient(spread_url) as client:
        answers = [
            client.decode(z, quality="high", output=output, scaling_factor=None) for output in ("float", "uint8")
        ]
    engine = DecodeEngine(ServiceConfig(model=str(kl_dir), device="cpu", **KL_SPREAD))
    with torch_threads(1):
        for answer, output in zip(answers, ("float", "uint8"), strict=True):
            request = DecodeRequest(z, quality="high", output=output, latents_scaled=True)
            (one,) = engine.decode([here_only(engine.prepare(request))])
            assert answer.tiled and answer.quality == "high"
            assert answer.timing["replicas"] == 2  # both replicas decoded tiles
            assert np.array_equal(answer.output, one.output.numpy())


def test_lossless_above_the_bound_is_diffusers_tiled_decode_its_tiles_on_two_replicas(spread_url, kl_dir):
    z = torch.randn(1, 4, 40, 36, generator=torch.Generator().manual_seed(22))
    with VaeClient(spread_url) as client:
        answer = client.decode(z, output="float", scaling_factor=None)
    reference = load_reference(kl_dir)  # the deployed folder, as loaded (a fresh one: tiling is set below)
    reference.enable_tiling()
    with torch.inference_mode(), torch_threads(1):
        want = reference.decode(z).sample
    assert answer.tiled and answer.quality == "lossless" and answer.timing["replicas"] == 2
    assert np.array_equal(answer.output, want.numpy())


def test_more_tiled_requests_than_replicas_all_answer_the_one_replica_bits_without_an_error(spread_url, kl_dir):
    """Saturation: six tiled requests at once on two replicas, no client retry; each answered 200
    with the one-replica plan's bits (a busy replica takes no tile; the idle one, some)."""
    from concurrent.futures import ThreadPoolExecutor

    zs = [torch.randn(2, 4, 24, 26, generator=torch.Generator().manual_seed(40 + i)) for i in range(6)]

    def decode(z):
        with VaeClient(spread_url, retries=0) as client:
            return client.decode(z, quality="high", output="float", scaling_factor=None)

    with ThreadPoolExecutor(len(zs)) as pool:
        answers = list(pool.map(decode, zs))
    engine = DecodeEngine(ServiceConfig(model=str(kl_dir), device="cpu", **KL_SPREAD))
    with torch_threads(1):
        for z, answer in zip(zs, answers, strict=True):
            (one,) = engine.decode(
                [here_only(engine.prepare(DecodeRequest(z, quality="high", output="float", latents_scaled=True)))]
            )
            assert answer.tiled and np.array_equal(answer.output, one.output.numpy())
