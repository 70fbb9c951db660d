"""The replica core without Ray: concurrent requests, live config changes."""

import asyncio

import pytest
import torch

from vae_service.config import Limits, ServiceConfig
from vae_service.protocol.decode_schema import DecodeParams
from vae_service.serving.decode_service import DecodeService, needs_new_engine
from tests.models import reference_decode


async def test_concurrent_lossless_requests_are_bit_identical_to_solo_decodes(kl_dir, kl_vae):
    service = DecodeService(ServiceConfig(model=str(kl_dir), model_name="kl"))
    gen = torch.Generator().manual_seed(7)
    latents = [torch.randn(b, 4, 4, 5, generator=gen) for b in (1, 3, 2, 1, 2)]
    responses = [o.wire() for o in await asyncio.gather(
        *(service.decode(DecodeParams(latents=z, scaling_factor=None, output="float", request_id=str(i)))
          for i, z in enumerate(latents))
    )]
    for i, (z, resp) in enumerate(zip(latents, responses)):
        assert resp["request_id"] == str(i)
        out = torch.frombuffer(bytearray(resp["output"]["data"]), dtype=torch.float32).reshape(resp["output"]["shape"])
        assert torch.equal(out, reference_decode(kl_vae, z))
        assert resp["timing"]["batch_size"] >= z.shape[0] and resp["timing"]["queue_ms"] >= 0


@pytest.mark.parametrize(
    "change, reload",
    [
        (dict(limits=Limits(max_batch_items=2)), False),
        (dict(decode_precision="bf16"), True),
        (dict(model="tiny-wan"), True),
        (dict(seed=5), True),
    ],
)
def test_only_weight_changes_reload_the_engine(change, reload):
    old = ServiceConfig(model="tiny-kl")
    assert needs_new_engine(old, old.model_copy(update=change)) is reload


async def test_precision_change_rematerialises_weights_and_drops_folded_buffers(kl_dir):
    config = ServiceConfig(model=str(kl_dir), model_name="kl")
    service = DecodeService(config)
    old = service.engine
    await service.decode(DecodeParams(latents=torch.randn(1, 4, 4, 4), quality="high"))
    assert old.fast_path.folded.nbytes > 0
    service.reconfigure(config.model_copy(update={"decode_precision": "bf16"}))
    assert old.fast_path.folded.nbytes == 0 and service.engine is not old
    assert all(p.dtype == torch.bfloat16 for p in service.engine.vae.parameters())
    resp = (await service.decode(DecodeParams(latents=torch.randn(1, 4, 4, 4), quality="high", output="float"))).wire()
    assert resp["precision"] == "bf16" and resp["output"]["dtype"] == "bfloat16"


def test_limit_change_keeps_the_engine(kl_dir):
    config = ServiceConfig(model=str(kl_dir), model_name="kl")
    service = DecodeService(config)
    engine = service.engine
    service.reconfigure(config.model_copy(update={"limits": Limits(max_batch_items=1)}))
    assert service.engine is engine and engine.config.limits.max_batch_items == 1
