"""Serve applications: `build_app(args)` for `serve run`/`serve build` and the CLI, `app` for YAML
configs whose `user_config` carries the ServiceConfig."""

from __future__ import annotations

from ray.serve import Application

from vae_service.config import ServiceConfig
from vae_service.serving.deployment import VaeDecoder


def build_app(args: dict | None = None, **deployment_options) -> Application:
    config = ServiceConfig.model_validate(args or {})
    return VaeDecoder.options(user_config=config.model_dump(), **deployment_options).bind()


app = build_app()
