"""The deploy YAMLs load into Serve's schema and build into our applications."""

import json
from pathlib import Path

import pytest
import yaml
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from vae_service.config import ServiceConfig
from vae_service.serving.app import GRPC_SERVICER, build_multi_app, router_options
from vae_service.serving.scheduling.admission import ADMISSION_ENV, admission_settings
from vae_service.serving.wire.proxy_guard import proxy_guard_env

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def built_the_way_serve_builds_it(app: dict) -> None:
    """Serve imports the builder and calls it with the YAML's args (exactly one parameter)."""
    built = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]), app.get("args", {}))
    assert type(built).__name__ == "Application"


@pytest.mark.parametrize("name", ["serve-cpu.yaml", "serve-gpu.yaml"])
def test_deploy_yaml_builds_a_single_model_app(name):
    raw = yaml.safe_load((DEPLOY / name).read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER]
    (app,) = raw["applications"]
    assert app["import_path"] == "vae_service.serving.app:build_app"
    built_the_way_serve_builds_it(app)
    config = ServiceConfig.model_validate(app["args"])
    (deployment,) = app["deployments"]
    assert deployment["name"] == "VaeDecoder"
    assert "user_config" not in deployment  # the live part comes from args unless overridden
    # a removed replica drains what it holds: never cut shorter than a request may take
    shutdown = deployment.get("graceful_shutdown_timeout_s", config.deployment_options()["graceful_shutdown_timeout_s"])
    assert shutdown >= config.batching.request_timeout_s
    if name == "serve-gpu.yaml":
        assert deployment["ray_actor_options"]["num_gpus"] == 1 and config.device == "cuda"
        scaling = deployment["autoscaling_config"]
        assert scaling["min_replicas"] <= scaling["initial_replicas"] <= scaling["max_replicas"]
        # a replica at its target still accepts a full batch for every key it fills
        assert scaling["target_ongoing_requests"] <= config.deployment_options()["max_ongoing_requests"]


def test_deployment_options_are_derived_from_the_config():
    config = ServiceConfig(
        batching={"max_batch_size": 3},
        serving={"concurrent_keys": 5, "max_queued_requests": 7, "backpressure_status": 503, "retry_after_s": 2},
    )
    assert config.deployment_options() == {
        "max_ongoing_requests": 15,
        "max_queued_requests": 7,
        "backpressure_config": {"status_code": 503, "retry_after_s": 2.0},
        "graceful_shutdown_timeout_s": config.batching.request_timeout_s + 5,
    }
    other = ServiceConfig(model="tiny-wan", serving={"max_queued_requests": 4})
    options = router_options([config, other])
    assert options["max_ongoing_requests"] == 15 + other.deployment_options()["max_ongoing_requests"]
    assert options["max_queued_requests"] == 11 and options["ray_actor_options"] == {"num_cpus": 0}
    unbounded = ServiceConfig(serving={"max_queued_requests": -1})
    assert router_options([config, unbounded])["max_queued_requests"] == -1


def test_multi_model_yaml_builds_one_router_and_a_decoder_per_model():
    raw = yaml.safe_load((DEPLOY / "serve-multi.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    (app,) = raw["applications"]
    assert app["import_path"] == "vae_service.serving.app:build_multi_app"
    built_the_way_serve_builds_it(app)
    configs = [ServiceConfig.model_validate(m) for m in app["args"]["models"]]
    assert [c.served_name for c in configs] == ["flux", "wan2.1"]
    with pytest.raises(ValueError, match="unique"):
        build_multi_app({"models": [{"model": "tiny-kl"}, {"model": "tiny-kl"}]})
    with pytest.raises(ValueError, match="at least one"):
        build_multi_app({"models": []})


def test_kuberay_rayservice_is_well_formed_and_its_serve_config_loads():
    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["rayVersion"].startswith("2.60")
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    (gpu_group,) = cluster["workerGroupSpecs"]
    worker = gpu_group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    for pod in (cluster["headGroupSpec"]["template"]["spec"], gpu_group["template"]["spec"]):
        assert pod["securityContext"]["runAsNonRoot"] is True
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    (app,) = serve_config.applications
    assert serve_config.grpc_options.grpc_servicer_functions == [GRPC_SERVICER]
    config = ServiceConfig.model_validate(app.args)
    for container in (head, worker):
        env = {e["name"]: e for e in container["env"]}
        # the proxy guard's environment is the one the application's own config gives
        guard = {name: env[name]["value"] for name in proxy_guard_env(config)}
        assert guard == proxy_guard_env(config)
        assert json.loads(guard[ADMISSION_ENV]) == admission_settings([config])
        assert env["VAE_SERVICE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
        assert not [name for name in env if name.startswith("VAE_SERVICE_PROXY_")]  # no longer read
    assert config.device == "cuda"
    (deployment,) = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["deployments"]
    assert deployment["ray_actor_options"]["num_gpus"] == 1
    # shutdown lets a replica drain what it holds: at least one request timeout
    assert deployment["graceful_shutdown_timeout_s"] >= config.batching.request_timeout_s
    built_the_way_serve_builds_it({"import_path": app.import_path, "args": app.args})
