"""The deploy YAMLs load into Serve's schema and into our ServiceConfig."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from vae_service.config import ServiceConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("name", ["serve-cpu.yaml"])
def test_deploy_yaml_parses_into_service_config(name):
    raw = yaml.safe_load((DEPLOY / name).read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(raw)
    (app,) = schema.applications
    assert app.import_path == "vae_service.serving.app:app"
    (deployment,) = raw["applications"][0]["deployments"]
    assert deployment["name"] == "VaeDecoder"
    config = ServiceConfig.model_validate(deployment["user_config"])
    assert config.decode_precision in ("fp32", "auto") and config.limits.max_batch_items > 0
