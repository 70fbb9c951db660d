"""A real replica takes a tile of another replica's request (`decode_tile_job`, a streaming method)
only for the fingerprint its own engine has: one sent by a replica of other weights, precision or
CPU thread count is refused in one message, so its tile is decoded by the request's replica
(tests/unit/test_shared_tiles.py blends such refusals bit for bit); one with no time left is
refused too; a taken tile answers the same bits as anywhere."""

import pytest
import torch

from tests.models import torch_threads
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine
from vae_service.engine.execution.peer_contract import Accepted, Chunk, End, OfferRefused
from vae_service.engine.runtime.tile_jobs import TierTile

pytestmark = pytest.mark.integration


def messages(handle, job, fingerprint: str, remaining_s: float = 30.0) -> list:
    return list(handle.decode_tile_job.remote(job, fingerprint, remaining_s))


@pytest.mark.parametrize("kind", ["kl", "wan"])
def test_a_replica_refuses_a_tile_from_an_engine_that_decodes_other_bits(ray_cluster, request, kind):
    from ray import serve

    from tests.integration.conftest import TEST_DEPLOYMENT
    from vae_service.serving.app import decoder_deployment

    folder = request.getfixturevalue(f"{kind}_dir")
    config = {"model": str(folder), "model_name": f"fingerprint-{kind}", "cpu_threads": 1}
    serve.run(decoder_deployment(config, **TEST_DEPLOYMENT), name=f"fingerprint-{kind}", route_prefix=None)
    try:
        handle = serve.get_app_handle(f"fingerprint-{kind}").options(stream=True)
        same = DecodeEngine(ServiceConfig(**{**config, "device": "cpu"}))
        differences = [{"decode_precision": "bf16"}, {"cpu_threads": 2}]
        if kind == "kl":
            differences.append({"fast_path": {"disable": ["upsample_fold"]}})
        others = [DecodeEngine(ServiceConfig(**{**config, "device": "cpu", **other})) for other in differences]
        frames = (2,) if kind == "wan" else ()
        z = torch.randn(1, 4, *frames, 8, 8, generator=torch.Generator().manual_seed(5))
        job = TierTile(z, "high")
        accepted = messages(handle, job, same.fingerprint)
        refused = [messages(handle, job, other.fingerprint) for other in others]
        late = messages(handle, job, same.fingerprint, 0.0)
    finally:
        serve.delete(f"fingerprint-{kind}")
    with torch_threads(1):
        here = list(same.run_tile(job, same.fingerprint))
    assert isinstance(accepted[0], Accepted) and accepted[-1] == End(len(here))
    assert all(isinstance(m, Chunk) for m in accepted[1:-1])
    assert all(torch.equal(m.pixels, h) for m, h in zip(accepted[1:-1], here, strict=True))  # the same bits
    assert all(len(r) == 1 and isinstance(r[0], OfferRefused) and "decodes as" in r[0].reason for r in refused)
    assert len(late) == 1 and "deadline" in late[0].reason
