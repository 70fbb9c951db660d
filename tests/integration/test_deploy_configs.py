"""The deploy YAMLs load into Serve's schema and into our ServiceConfig."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from vae_service.config import ServiceConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("name", ["serve-cpu.yaml", "serve-gpu.yaml"])
def test_deploy_yaml_parses_into_service_config(name):
    raw = yaml.safe_load((DEPLOY / name).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "vae_service.serving.app:app"
    (deployment,) = raw["applications"][0]["deployments"]
    assert deployment["name"] == "VaeDecoder"
    config = ServiceConfig.model_validate(deployment["user_config"])
    assert config.limits.max_batch_items > 0
    # Serve's own options agree with what the config derives (batches can fill)
    assert deployment["max_ongoing_requests"] >= config.batching.max_batch_size * config.serving.concurrent_keys
    assert deployment["backpressure_config"]["status_code"] in (429, 503)
    if name == "serve-gpu.yaml":
        assert deployment["ray_actor_options"]["num_gpus"] == 1 and config.device == "cuda"
        scaling = deployment["autoscaling_config"]
        assert scaling["min_replicas"] <= scaling["initial_replicas"] <= scaling["max_replicas"]


def test_multi_model_yaml_builds_one_router_and_a_decoder_per_model():
    raw = yaml.safe_load((DEPLOY / "serve-multi.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    (app,) = raw["applications"]
    assert app["import_path"] == "vae_service.serving.app:build_multi_app"
    configs = [ServiceConfig.model_validate(m) for m in app["args"]["models"]]
    assert [c.served_name for c in configs] == ["flux", "wan2.1"]
    from vae_service.serving.app import build_multi_app

    built = build_multi_app(app["args"])  # binds without starting anything
    assert built is not None
    with pytest.raises(ValueError, match="unique"):
        build_multi_app({"models": [{"model": "tiny-kl"}, {"model": "tiny-kl"}]})
