"""Serve applications. Each decode deployment is built with its ServiceConfig as deployment
arguments (model, precision, device and fast path fixed per replica: changing them rolls
replicas) and the config's live part as `user_config` (limits and batching, applied in place).

- `build_app(args)`: one model; the decode deployment is its own HTTP ingress (fewest hops).
- `build_decoder(args)`: one model to bind into your own ingress (see deploy/pipeline_app.py).
- `build_multi_app({"models": [args, ...]})`: several models behind one routing ingress.
- `app`: one model with the default config (`serve run vae_service.serving.app:app`).

YAML files use the builders as `import_path` and the config as `args` (Serve calls a builder with
exactly one argument). From Python, `decoder_app`, `decoder_deployment` and `multi_model_app` take
Serve deployment options on top (replicas, autoscaling, actor resources, shutdown timeouts).
"""

from __future__ import annotations

from ray.serve import Application

from vae_service.config import ServiceConfig
from vae_service.serving.deployment import VaeDecoder, VaeDecoderHttp
from vae_service.serving.router import VaeRouter
from vae_service.serving.scheduling.admission import admission_settings
from vae_service.serving.scheduling.class_router import ROUTER_PATH, ROUTING_STATS_PERIOD_S

# what Serve's gRPC proxy needs in `grpc_servicer_functions` (serve.start, YAML grpc_options)
GRPC_SERVICER = "vae_service_client.grpc_gen.decode_pb2_grpc.add_VaeDecoderServicer_to_server"


def _decoder(config: ServiceConfig, deployment=VaeDecoder, **deployment_options) -> Application:
    """`deployment_options` (num_replicas, autoscaling_config, ray_actor_options, ...) override
    the options derived from the config (max_ongoing_requests, max_queued_requests, backpressure)."""
    # a decode session's calls reach the replica that holds it, other calls the replica with the least
    # work their class waits behind (serving/scheduling/class_router.py)
    routing = {
        "request_router_config": {
            "request_router_class": ROUTER_PATH,
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        }
    }
    options = {**config.deployment_options(), **routing, **deployment_options}
    # the replica checks live changes against what Serve enforces, and drains within it
    enforced = {k: options[k] for k in ("max_ongoing_requests", "graceful_shutdown_timeout_s") if k in options}
    return deployment.options(user_config=config.live().model_dump(), **options).bind(config.model_dump(), enforced)


def decoder_app(args: dict | None = None, **deployment_options) -> Application:
    """One model, serving HTTP itself."""
    return _decoder(ServiceConfig.model_validate(args or {}), VaeDecoderHttp, **deployment_options)


def decoder_deployment(args: dict | None = None, **deployment_options) -> Application:
    """One model without HTTP routes: to bind into another ingress (composition)."""
    return _decoder(ServiceConfig.model_validate(args or {}), **deployment_options)


def router_options(configs: list[ServiceConfig]) -> dict:
    """The router holds each request while a decoder works on it, so it accepts as many ongoing
    and queued requests as its decoders together, answers overload like them, and needs no CPU
    (like Serve's own proxy; on a 2-CPU machine a CPU for it would leave a decoder unscheduled)."""
    decoder_options = [c.deployment_options() for c in configs]
    queued = [o["max_queued_requests"] for o in decoder_options]
    return {
        "max_ongoing_requests": sum(o["max_ongoing_requests"] for o in decoder_options),
        "max_queued_requests": -1 if -1 in queued else sum(queued),
        "backpressure_config": decoder_options[0]["backpressure_config"],
        "ray_actor_options": {"num_cpus": 0},
    }


def multi_model_app(args: dict, **deployment_options) -> Application:
    configs = [ServiceConfig.model_validate(m) for m in args.get("models") or []]
    if not configs:
        raise ValueError("models: give at least one model config")
    names = [c.served_name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"models: served names must be unique (set model_name), got {names}")
    admission = admission_settings(configs)  # the router's: one token, the largest limits
    decoders = {c.served_name: _decoder(c, name=f"VaeDecoder-{c.served_name}", **deployment_options) for c in configs}
    router = VaeRouter.options(**router_options(configs))
    return router.bind(
        decoders,
        admission["max_request_bytes"],
        admission["body_timeout_s"],
        admission["auth_token_file"],
        admission["retry_after_s"],
    )


def build_app(args: dict) -> Application:
    return decoder_app(args)


def build_decoder(args: dict) -> Application:
    return decoder_deployment(args)


def build_multi_app(args: dict) -> Application:
    return multi_model_app(args)


app = decoder_app()
