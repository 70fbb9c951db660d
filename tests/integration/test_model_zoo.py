"""A class of each kind the service tells apart, and one it does not name, served from diffusers
folders behind one routing ingress: `lossless` over HTTP, gRPC and handles is each item's pipeline decode alone, bit
for bit; video classes stream their frames; /health says how each model is decoded."""

import numpy as np
import pytest
from ray import serve

from tests.integration.conftest import TEST_DEPLOYMENT
from tests.models import load_reference, save_vae, torch_threads
from tests.zoo import BY_NAME, build, decode_alone, latents
from vae_service_client import VaeClient, VaeGrpcClient

pytestmark = pytest.mark.integration

# one class of each kind the service tells apart (packed image latents, causal video, a decode
# timestep's video, one it does not name) and Qwen-Image (its decode reads its encoder: diffusers' own
# decode of a decoder-only load fails, the service's does not): every other class the service names is
# decoded from its saved folder bit for bit by the unit suite (test_loading.py, test_model_classes.py);
# here, five replicas rather than thirteen start beside the other apps (a minute of the suite's time)
SERVED = ["flux2", "qwen-image", "wan2.2", "ltx-video-timestep", "kvae-video"]
APP = "zoo"


@pytest.fixture(scope="module")
def zoo(ray_cluster, tmp_path_factory):
    from vae_service.serving.app import multi_model_app

    references, models = {}, []
    for name in SERVED:
        folder = save_vae(build(BY_NAME[name], seed=11), tmp_path_factory.mktemp(name))
        references[name] = load_reference(folder)  # what the service loads, as diffusers loads it
        # the replicas start at once on the test cluster's CPUs: no class tiled price fitted
        # beside start-up (68 s of CPU in all; none of these requests is above the bound)
        models.append({"model": str(folder), "model_name": name, "cpu_threads": 1,
                       "serving": {"fit_prices_at_start": False}})  # fmt: skip
    # no CPU reserved per replica: the tiny decoders share the test cluster's CPUs
    app = multi_model_app({"models": models}, ray_actor_options={"num_cpus": 0}, **TEST_DEPLOYMENT)
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield f"{ray_cluster}/{APP}", references
    serve.delete(APP)


def expected_of(vaes, name, z):
    with torch_threads(1):
        return decode_alone(vaes[name], BY_NAME[name], z).numpy()


@pytest.mark.parametrize("name", SERVED)
def test_lossless_over_http_grpc_and_handles(zoo, grpc_target, name):
    url, vaes = zoo
    case = BY_NAME[name]
    z = latents(case, batch=2, seed=21)
    expected = expected_of(vaes, name, z)
    options = dict(model=name, output="float", decode_timestep=case.timestep)
    with VaeClient(url) as client:
        http = client.decode(z, **options)
    with VaeGrpcClient(grpc_target, application=APP) as client:
        grpc_answer = client.decode(z, **options)
    handle = serve.get_app_handle(APP).decode.remote(z.numpy(), **options).result()
    for answer in (http.output, grpc_answer.output, handle["output"]):
        np.testing.assert_array_equal(answer, expected)
    assert http.model == grpc_answer.model == handle["model"] == name
    assert http.quality == "lossless"


@pytest.mark.parametrize("name", ["ltx-video-timestep", "wan2.2"])
def test_video_classes_stream_their_frames(zoo, grpc_target, name):
    url, vaes = zoo
    case = BY_NAME[name]
    z = latents(case, batch=1, seed=22)
    with VaeClient(url) as client:
        whole = client.decode(z, model=name).output
        streamed = client.decode_frames(z, model=name)
        frames = streamed.collect()
    with VaeGrpcClient(grpc_target, application=APP) as client:
        over_grpc = client.decode_frames(z, model=name).collect()
    np.testing.assert_array_equal(frames, whole)
    np.testing.assert_array_equal(over_grpc, whole)
    assert whole.shape[1] == expected_of(vaes, name, z).shape[2]


@pytest.mark.parametrize("name", SERVED)
def test_every_model_answers_previews(zoo, name):
    url, _ = zoo
    case = BY_NAME[name]
    z = latents(case, batch=2, seed=24)
    with VaeClient(url) as client:
        preview = client.decode(z, model=name, quality="preview", decode_timestep=case.timestep)
        full = client.decode(z, model=name, decode_timestep=case.timestep)
    assert preview.quality == "preview" and preview.output.shape == full.output.shape
    assert preview.output.dtype == full.output.dtype and not (preview.output == full.output).all()


def test_high_on_a_model_without_a_fast_path_says_lossless(zoo):
    url, vaes = zoo
    z = latents(BY_NAME["kvae-video"], batch=1, seed=23)
    with VaeClient(url) as client:
        answer = client.decode(z, model="kvae-video", quality="high", output="float")
        flux2 = client.decode(latents(BY_NAME["flux2"], batch=1), model="flux2", quality="high")
    assert answer.quality == "lossless" and flux2.quality == "high"
    np.testing.assert_array_equal(answer.output, expected_of(vaes, "kvae-video", z))


def test_health_lists_each_models_path_and_geometry(zoo):
    url, _ = zoo
    with VaeClient(url) as client:
        health = client.health()
    models = health["models"]
    assert set(models) == set(SERVED)
    assert models["flux2"]["decode_path"] == "image_kl" and models["wan2.2"]["decode_path"] == "causal_walk"
    assert models["kvae-video"]["decode_path"] == "generic"
    assert models["wan2.2"]["geometry"]["spatial_scale"] == 16
    assert models["ltx-video-timestep"]["decode_timestep_default"] == 0.0
