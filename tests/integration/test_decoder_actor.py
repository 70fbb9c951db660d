"""The decoder as a plain Ray actor: in a Ray DAG and a compiled graph (latents handed over by a
stand-in denoiser actor), typed errors through both, tier batching of concurrent calls, and the
folded buffers given back when asked and when the actor exits."""

import glob
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.dag import InputNode

from deploy.dag_pipeline import StandInDenoiser, build_dag
from tests.models import reference_decode, torch_threads
from vae_service.ray import DecoderActor
from vae_service_client import InvalidRequest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def decoders(ray_cluster, kl_dir, wan_dir):
    actors = {
        name: DecoderActor.remote({"model": str(folder), "model_name": name, "cpu_threads": 1})
        for name, folder in (("kl", kl_dir), ("wan", wan_dir))
    }
    yield actors
    for actor in actors.values():
        ray.kill(actor)


@pytest.fixture(scope="module")
def denoisers(ray_cluster, wan_reference):
    """One stand-in denoiser per model, in a plain DAG and in a compiled graph alike (a compiled
    graph's teardown leaves its actors usable, as the decoders above): each is a process that
    imports torch and the engine."""
    shapes = {"kl": [1, 4, 5, 7], "wan": [1, wan_reference.config.z_dim, 2, 3, 5]}  # odd sides
    actors = {name: (StandInDenoiser.remote(shape), shape) for name, shape in shapes.items()}
    yield actors
    for actor, _ in actors.values():
        ray.kill(actor)


@pytest.mark.parametrize("compiled", [False, True], ids=["dag", "compiled"])
@pytest.mark.parametrize("name", ["kl", "wan"])
def test_dag_round_trip_is_diffusers_lossless_decode(decoders, denoisers, request, name, compiled):
    vae = request.getfixturevalue(f"{name}_reference")  # the actor loaded its folder
    denoiser, shape = denoisers[name]
    dag = build_dag(denoiser, decoders[name], compiled, output="float", scaling_factor=None)
    try:
        for seed in (0, 1):
            got = ray.get(dag.execute(seed), timeout=120)
            z = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            with torch_threads(1):
                expected = reference_decode(vae, z)
            assert got["model"] == name and got["quality"] == "lossless"
            np.testing.assert_array_equal(got["output"], expected.numpy())
    finally:
        if compiled:
            dag.teardown()


@pytest.mark.parametrize("compiled", [False, True], ids=["dag", "compiled"])
def test_bad_request_raises_the_typed_error_through_the_graph(decoders, compiled):
    with InputNode() as latents:
        dag = decoders["kl"].decode.bind(latents, quality="high")
    dag = dag.experimental_compile() if compiled else dag
    try:
        with pytest.raises(InvalidRequest) as err:
            ray.get(dag.execute(torch.zeros(1, 3, 4, 4)), timeout=120)  # 3 channels, the model has 4
        assert (err.value.status, err.value.type, err.value.field) == (400, "invalid_request", "latents")
        assert "takes [B, 4, H, W]" in err.value.message
        # the graph and the actor go on decoding
        assert ray.get(dag.execute(torch.zeros(1, 4, 4, 4)), timeout=120)["output"].shape == (1, 32, 32, 3)
    finally:
        if compiled:
            dag.teardown()


def test_concurrent_calls_batch_by_tier_never_mixed(ray_cluster, kl_dir, kl_reference):
    # a batch waits (up to 30 s) for a second item of its own key: two per tier, each tier alone
    decoder = DecoderActor.remote(
        {"model": str(kl_dir), "cpu_threads": 1, "batching": {"max_batch_size": 2, "batch_wait_ms": 30_000}}
    )
    z = [torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    qualities = ["high", "lossless", "high", "lossless"]
    try:
        with ThreadPoolExecutor(4) as pool:
            calls = [
                pool.submit(ray.get, decoder.decode.remote(zi, quality=q, output="float", scaling_factor=None))
                for zi, q in zip(z, qualities, strict=True)
            ]
            results = [c.result(timeout=120) for c in calls]
        assert [r["quality"] for r in results] == qualities
        assert [r["timing"]["batch_size"] for r in results] == [2, 2, 2, 2]
        with torch_threads(1):  # lossless items decoded alone within their batch
            for zi, r, q in zip(z, results, qualities, strict=True):
                if q == "lossless":
                    np.testing.assert_array_equal(r["output"], reference_decode(kl_reference, zi).numpy())
    finally:
        ray.kill(decoder)


def _folded_bytes(decoder) -> int:
    return ray.get(decoder.describe.remote())["fast_path"]["folded_bytes"]


def test_folded_buffers_released_when_asked(decoders):
    decoder = decoders["kl"]
    ray.get(decoder.decode.remote(torch.zeros(1, 4, 4, 4), quality="high"))
    folded = _folded_bytes(decoder)
    assert folded > 0
    assert ray.get(decoder.release_folded.remote()) == folded
    assert _folded_bytes(decoder) == 0


def test_graceful_exit_drains_and_releases_folded_buffers(ray_cluster, kl_dir):
    decoder = DecoderActor.remote({"model": str(kl_dir), "cpu_threads": 1})
    ray.get(decoder.decode.remote(torch.zeros(1, 4, 4, 4), quality="high"))
    folded, pid = _folded_bytes(decoder), ray.get(decoder.describe.remote())["pid"]
    assert folded > 0
    decoder.__ray_terminate__.remote()
    # the actor's own log (Ray writes each worker's stderr to a file) says what it gave back
    logs = f"{ray._private.worker._global_node.get_session_dir_path()}/logs/worker-*-{pid}.err"
    wanted = f"released {folded} bytes of folded buffers"
    deadline = time.monotonic() + 60
    while not any(wanted in Path(f).read_text() for f in glob.glob(logs)):
        assert time.monotonic() < deadline, f"no {wanted!r} in {glob.glob(logs)}"
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(decoder.describe.remote(), timeout=60)
