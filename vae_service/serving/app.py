"""Serve applications: `build_app(args)` for `serve run`/`serve build` and the CLI, `app` for YAML
configs whose `user_config` carries the ServiceConfig."""

from __future__ import annotations

from ray.serve import Application

from vae_service.config import ServiceConfig
from vae_service.serving.deployment import VaeDecoder


def build_app(args: dict | None = None, **deployment_options) -> Application:
    """`deployment_options` (num_replicas, autoscaling_config, ray_actor_options, ...) override
    the options derived from the config (max_ongoing_requests, max_queued_requests, backpressure)."""
    config = ServiceConfig.model_validate(args or {})
    options = {**config.deployment_options(), **deployment_options}
    return VaeDecoder.options(user_config=config.model_dump(), **options).bind()


app = build_app()
