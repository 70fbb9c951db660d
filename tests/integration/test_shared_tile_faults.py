"""Shared tiles on real replicas with injected faults (tests/integration/faulty_replica.py): a replica
that hangs with a tile ends the request at its deadline (504); a caller that leaves while a tile is
out frees every replica's device within slices; the out-of-memory retry shares its tiles through the
same executor; a replica that would decode other bits (bf16 beside fp32) never has its bits blended."""

import json
import time

import numpy as np
import pytest
import torch

from tests.models import torch_threads
from tests.peers import here_only
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeRequest
from vae_service_client import DecodeTimeout

pytestmark = pytest.mark.integration

TWO_REPLICAS = {"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2}
# 2x24x26 tiny-kl latents are over 16 MiB in `high` (16 tiles an item); 16x16 fits whole
CONFIG = {"cpu_threads": 1, "limits": {"max_decode_bytes": 16 * 2**20}, "batching": {"request_timeout_s": 6.0}}


def deploy(name: str, folder, faults, skew_first: bool = False):
    from ray import serve

    from tests.integration.conftest import TEST_DEPLOYMENT
    from tests.integration.faulty_replica import faulty_app

    config = {"model": str(folder), "model_name": name, **CONFIG}
    options = dict(TEST_DEPLOYMENT, autoscaling_config=TWO_REPLICAS, ray_actor_options={"num_cpus": 0})
    serve.run(faulty_app(config, faults, skew_first, **options), name=name, route_prefix=None)
    return serve.get_app_handle(name), config


@pytest.fixture(scope="module")
def faulty(ray_cluster, kl_dir, tmp_path_factory):
    from ray import serve

    faults = tmp_path_factory.mktemp("faults") / "faults.json"
    handle, config = deploy("faulty", kl_dir, faults)
    yield handle, faults, config
    serve.delete("faulty")


def set_fault(faults, **fault) -> None:
    faults.write_text(json.dumps(fault))
    for mark in (".taken", ".batch-done"):
        faults.with_suffix(mark).unlink(missing_ok=True)


def over_the_bound(seed: int) -> torch.Tensor:
    return torch.randn(2, 4, 24, 26, generator=torch.Generator().manual_seed(seed))


def appears(path, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.01)
    return path.exists()


def test_a_replica_that_hangs_with_a_tile_ends_the_request_at_its_deadline(faulty):
    handle, faults, _ = faulty
    set_fault(faults, tiles="hang")
    start = time.monotonic()
    with pytest.raises(DecodeTimeout) as timed_out:
        handle.decode.remote(over_the_bound(1), quality="high", scaling_factor=None).result()
    elapsed = time.monotonic() - start
    assert timed_out.value.status == 504 and 5.0 < elapsed < 10.0  # its 6 s deadline, not a 503
    assert appears(faults.with_suffix(".batch-done"), 2.0)  # and its device thread is free again
    set_fault(faults)


def test_a_caller_that_leaves_while_a_tile_is_out_frees_the_devices_within_slices(faulty):
    handle, faults, _ = faulty
    set_fault(faults, tiles="hang")
    response = handle.decode.remote(over_the_bound(2), quality="high", scaling_factor=None)
    assert appears(faults.with_suffix(".taken"), 30)  # a replica took a tile and hangs with it
    done = faults.with_suffix(".batch-done")
    assert not done.exists()  # the request's replica waits for that tile on its device thread
    response.cancel()
    assert appears(done, 2.0)  # freed within slices: the request's 6 s deadline is not what ended it
    set_fault(faults)


def test_the_out_of_memory_retry_shares_its_tiles_with_the_other_replica(faulty, kl_dir):
    handle, faults, config = faulty
    set_fault(faults, out_of_memory=[16, 16])
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    answer = handle.decode.remote(z, quality="high", output="float", scaling_factor=None).result()
    set_fault(faults)
    engine = DecodeEngine(ServiceConfig(**{**config, "device": "cpu"}))
    ran_out = []

    def once(module, args):
        if list(args[0].shape[-2:]) == [16, 16] and not ran_out:
            ran_out.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    engine.vae.decoder.register_forward_pre_hook(once)
    with torch_threads(1):
        (here,) = engine.decode([engine.prepare(DecodeRequest(z, quality="high", output="float", latents_scaled=True))])
    assert answer["tiled"] and here.tiled and ran_out
    assert answer["timing"]["replicas"] == 2  # the retry's tiles went to the other replica too
    assert np.array_equal(answer["output"], here.output.numpy())  # the retry plan's bits


def test_a_replica_that_would_decode_other_bits_never_has_them_blended(ray_cluster, kl_dir, tmp_path):
    from ray import serve

    handle, config = deploy("skewed", kl_dir, tmp_path / "faults.json", skew_first=True)
    answers = {}
    try:
        for seed in range(12):  # until each replica answered one (Serve picks the replica)
            z = over_the_bound(10 + seed)
            answer = handle.decode.remote(z, quality="high", output="float", scaling_factor=None).result()
            answers.setdefault(answer["precision"], (z, answer))
            if len(answers) == 2:
                break
    finally:
        serve.delete("skewed")
    assert set(answers) == {"fp32", "bf16"} and answers["fp32"][1]["tiled"]
    for precision, (z, answer) in answers.items():
        engine = DecodeEngine(ServiceConfig(**{**config, "device": "cpu", "decode_precision": precision}))
        with torch_threads(1):
            request = DecodeRequest(z, quality="high", output="float", latents_scaled=True)
            (here,) = engine.decode([here_only(engine.prepare(request))])
        assert answer["tiled"] == here.tiled and answer["timing"]["replicas"] == 1  # the other refused every tile
        want = here.output.float().numpy()
        assert np.array_equal(np.asarray(answer["output"], dtype=np.float32), want), precision
