"""A decode replica's start and end as Serve drives them, in-process (no Ray): one short start-up
line, a warning when its cluster runs without the proxy guard, and a destructor that, after a
constructor that raised (Serve still calls it), adds no second traceback to the real one."""

import logging

import pytest

from vae_service.models import ModelLoadError
from vae_service.serving.replica import DecoderReplica
from vae_service.serving.wire.proxy_guard import CALLBACK_ENV


async def test_a_replica_whose_constructor_raised_is_destroyed_quietly():
    replica = DecoderReplica.__new__(DecoderReplica)  # what Serve holds when __init__ raises
    with pytest.raises(ModelLoadError, match="model: 'tiny-k1'"):
        replica.__init__({"model": "tiny-k1"})
    await replica.__del__()  # was: AttributeError: 'DecoderReplica' object has no attribute 'service'


@pytest.mark.parametrize("guarded", [True, False])
async def test_start_up_logs_one_short_line_and_warns_without_the_guard(monkeypatch, caplog, guarded):
    if guarded:
        monkeypatch.setenv(CALLBACK_ENV, "vae_service.serving.wire.proxy_guard:middlewares")
    else:
        monkeypatch.delenv(CALLBACK_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        replica = DecoderReplica({"model": "tiny-kl", "cpu_threads": 1})
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "ray.serve"]
        assert lines[0] == "serving tiny-kl (AutoencoderKL, random weights) at fp32 on cpu, tiers lossless/high/preview"
        assert max(len(line) for line in lines) <= 140  # the whole description is GET /health's
        warned = [line for line in lines if "no proxy guard" in line]
        assert warned == ([] if guarded else [warned[0]]) and (guarded or "vae-service guard-env" in warned[0])
    finally:
        await replica.__del__()
