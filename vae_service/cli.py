"""`vae-service serve | decode | batch-decode | bench | guard-env`: the only place that parses argv."""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import re
import shlex
import signal
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from vae_service.names import IMAGE_OUTPUTS, PRESET_NAMES, PRIORITIES, VIDEO_OUTPUTS, unknown_source

if TYPE_CHECKING:
    from pydantic import ValidationError

    from vae_service.config import ServiceConfig

# Imports beyond the standard library and vae_service.names sit in the functions that need them:
# `decode` and every --help start in well under a second and load no torch, Ray or diffusers
# (tests/unit/test_cli_start.py), and `serve` refuses a mistyped model or field, or a port in use,
# before it loads any of them.
log = logging.getLogger("vae_service")


# Exit statuses of `serve` and `batch-decode` refusing to start: 2 for what the user wrote (a
# configuration field, a model, argparse's own usage errors), 1 for the machine (a port in use).
EXIT_CONFIG, EXIT_ENVIRONMENT = 2, 1


def refuse(message: str, status: int = EXIT_CONFIG) -> NoReturn:
    """One line on stderr, then exit: what is wrong and how to fix it, never a traceback; never a
    secret either (storage's scrub: a location in it as `redact` shows it, a store's own words too)."""
    from vae_service.storage.locations import scrub

    print(f"vae-service: {scrub(message)}", file=sys.stderr, flush=True)
    sys.exit(status)


def _read_config_file(path: str) -> dict:
    """A ServiceConfig as YAML or JSON (JSON is YAML too)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        refuse(f"--config {path}: {' '.join(str(exc).split())}")
    if not isinstance(data, dict):
        refuse(f"--config {path}: must hold a map of ServiceConfig fields")
    return data


def _fields_at(loc: tuple) -> list[str]:
    """The field names of the config section at `loc` (for close matches to an unknown one)."""
    from pydantic import BaseModel

    from vae_service.config import ServiceConfig

    model = ServiceConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def config_errors(exc: ValidationError) -> str:
    """pydantic's errors as one line: each field's dotted name, what is wrong, and close matches
    for an unknown field or value ("did you mean")."""
    from vae_service_client.errors import did_you_mean

    parts = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        secret = loc[:1] == ("sinks",) or exc.title == "Sink"  # a sink's value may hold a secret: never shown
        name = ".".join(map(str, loc)) or "config"
        if err["type"] == "extra_forbidden":
            parts.append(f"{name}: unknown field{did_you_mean(loc[-1], _fields_at(loc[:-1]))}")
        elif err["type"] == "literal_error" and not secret:
            choices = re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected", "")))
            got = err.get("input")
            parts.append(f"{name}: {got!r} is not one of {', '.join(choices)}{did_you_mean(got, choices)}")
        else:
            got = "" if secret else f" (got {err.get('input')!r})"
            parts.append(f"{name}: {err['msg']}{got}")
    return "invalid configuration: " + "; ".join(parts)


def _config_from(args: argparse.Namespace) -> ServiceConfig:
    """--config FILE first, then the flags that were given on top of it."""
    from pydantic import ValidationError

    from vae_service.config import ServiceConfig

    data = _read_config_file(args.config) if getattr(args, "config", None) else {}
    flags = {
        "model": args.model,
        "decode_precision": args.precision,
        "device": args.device,
        "auth_token_file": getattr(args, "auth_token_file", None),
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as exc:
        refuse(config_errors(exc))


def check_model(config: ServiceConfig) -> None:
    """The model source, checked as far as it can be without loading it (before Ray starts): by
    its name alone (a preset, a hub id, or a path that exists: no torch), then a local folder's
    config and weights (models/loading.py, which imports diffusers: seconds, only for a folder)."""
    for field, source in (("model", config.model), ("preview_decoder", config.preview_decoder)):
        if source is None or source in PRESET_NAMES:
            continue
        why = unknown_source(source)
        if why is None and Path(source).expanduser().exists():
            why = _folder_problem(source)
        if why is not None:
            refuse(why if field == "model" else f"preview_decoder: {why.removeprefix('model: ')}")


def _folder_problem(source: str) -> str | None:
    """What is wrong with a local model folder (its config names no served class, no weights)."""
    from vae_service.models import ModelLoadError
    from vae_service.models.loading import check_source

    try:
        check_source(source)
    except ModelLoadError as exc:
        return str(exc)
    return None


def port_in_use(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on at `host` (another process holds it, or the address is not
    this machine's), or None. SO_REUSEADDR as Serve's proxy binds: connections a previous run left
    in TIME_WAIT are no conflict; without SO_REUSEPORT: a listener that shares its port (another
    Serve) is one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None if family == socket.AF_INET6 else "no IPv4"  # no IPv6 on this host: gRPC uses IPv4
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # as gRPC's [::]: IPv4 too
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_ports(host: str, port: int, grpc_port: int) -> None:
    """Both ports free before Ray starts (Serve's proxy binds them exclusively too: proxy_guard.py)."""
    if grpc_port and grpc_port == port:
        refuse(f"--port and --grpc-port are both {port}: give gRPC another port (or 0 to turn it off)")
    checks = [(host, port, "HTTP", "--port", "PORT")]
    if grpc_port:  # Serve's gRPC proxy listens on every interface ([::]), whatever --host says
        checks.append(("::", grpc_port, "gRPC", "--grpc-port", "GRPC_PORT"))
    for address, number, what, flag, make_var in checks:
        why = port_in_use(address, number)
        if why is not None:
            where = "on all interfaces" if address == "::" else f"on {address}"
            refuse(
                f"port {number} ({what}) {where} is not free ({why}): another service holds it; choose "
                f"another with {flag} N (make serve {make_var}=N)",
                EXIT_ENVIRONMENT,
            )


def example_command(url: str, latent_shape: str) -> str:
    """A decode call a user can paste into a new shell: the `vae-service` script beside this
    interpreter, by its absolute path (it is on the PATH only inside the virtual environment)."""
    script = Path(sys.executable).with_name("vae-service")
    command = shlex.quote(str(script)) if script.is_file() else f"{shlex.quote(sys.executable)} -m vae_service.cli"
    return f"{command} decode --url {url} --random-latents {latent_shape} --out out"


def _example_shape(health: dict) -> str:
    """Latents of about 128 px for the served model (a few seconds even for the full-size presets
    on a 2-core CPU), from the geometry its replica traced; a video model's have 3 latent frames
    (a clip, not one image), or as many as its decoder needs."""
    geometry = health["geometry"]
    side = max(geometry["min_latent_side"], 128 // geometry["spatial_scale"])
    frames = max(geometry.get("min_latent_frames", 1), 3 if health["family"] == "video" else 1)
    return "x".join(map(str, [1, geometry["latent_channels"], *([frames] if frames > 1 else []), side, side]))


def banner(name: str, health: dict, url: str, grpc_port: int, token: bool) -> str:
    """What `serve` prints once the service answers: short, true, ending with the command to try."""
    weights = "SEEDED RANDOM WEIGHTS: it decodes noise" if "random" in health["weights"] else "weights loaded"
    exposed = "" if token else "; no token: anyone who reaches this host can call it"
    grpc = (
        f"port {grpc_port}, metadata application=vae (all interfaces: Serve has no gRPC host{exposed})"
        if grpc_port
        else "off (--grpc-port N, make serve GRPC_PORT=N)"
    )
    return "\n".join(
        [
            "",
            f"vae-service is serving '{name}' ({health['class']}, {weights}; {health['precision']} on "
            f"{health['device']}, tiers {', '.join(health['tiers'])})",
            f"  HTTP  {url}  POST /decode, POST /remote-decode, GET /health" + ("  (bearer token)" if token else ""),
            f"  gRPC  {grpc}",
            "Ctrl-C stops it. Try it from another shell (random latents -> PNGs in ./out):",
            f"  {example_command(url, _example_shape(health))}",
            "",
        ]
    )


def _warn_about_exposure(config: ServiceConfig, host: str) -> bool:
    """Whether a token is configured; one line on stderr when HTTP is reachable from elsewhere
    without one (gRPC's exposure is in the banner)."""
    from vae_service.serving.scheduling.admission import load_token

    try:
        token = load_token(config.auth_token_file)
    except (OSError, ValueError) as exc:
        refuse(f"auth_token_file: {exc}")
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError) as exc:
        refuse(f"--host {host}: {exc}")
    if not token and not loopback:
        print(
            f"vae-service: warning: no bearer token and HTTP listens on {host}: anyone who reaches this host can "
            "decode; set VAE_SERVICE_AUTH_TOKEN or --auth-token-file, and put TLS in front",
            file=sys.stderr,
        )
    return bool(token)


def _start_ray() -> None:
    """Join RAY_ADDRESS or start a local Ray, saying only what its user can act on: its warnings
    and errors, not its INFO lines, nor "Token authentication is enabled" (Ray's default for the
    local cluster it starts: nothing to do; with RAY_AUTH_MODE=disabled its warning that the
    cluster is open stays)."""
    import ray

    if "RAY_AUTH_MODE" not in os.environ:  # Ray turns token auth on for its local cluster and says so
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)


def _quiet_serve() -> dict:
    """The terminal shows warnings and errors of Serve's own components, not their INFO chatter:
    "New http_options ... will not be applied" (serve.run's own serve.start; ours was applied), the
    proxy's routing tables on one line of hundreds of characters. Replicas log at INFO (their
    start-up line, requests). Returns serve.start's logging_config."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this process's Serve client
    return {"log_level": "WARNING"}  # Serve's controller and proxies


def _quiet_ray_data() -> None:
    """Ray Data's lines on the terminal are its warnings and errors, not what the job says itself:
    the dataset's id and plan at the start and "execution finished" at the end (INFO: the job's
    progress and summary say it; they stay in the session's logs/ray-data.log), and "Progress bars
    disabled" (they are: the job shows its own progress)."""
    from ray.data import DataContext

    context = DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # says only which bars show
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)  # the terminal's; its file handler keeps INFO


def _start_failure(exc: Exception) -> str:
    """serve.run's exception as one line: the model's own error when the replica's constructor
    raised one (Serve keeps it in the deployment's status message; the replica's log holds its one
    traceback), else the last line Serve gave."""
    from ray import serve

    try:
        status = serve.status().applications["vae"]
        texts = [status.message, *(d.message for d in status.deployments.values())]
    except Exception:  # Serve itself went away
        texts = []
    found = re.findall(r"ModelLoadError: (.+)", "\n".join([*texts, str(exc)]))
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"the application failed to start: {lines[-1] if lines else type(exc).__name__}"


def cmd_serve(args: argparse.Namespace) -> None:
    config = _config_from(args)
    check_model(config)
    token = _warn_about_exposure(config, args.host)
    check_ports(args.host, args.port, args.grpc_port)
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from vae_service.serving.app import GRPC_SERVICER, decoder_app
    from vae_service.serving.scheduling.admission import Admission
    from vae_service.serving.wire.proxy_guard import proxy_guard_env

    # a local Ray started below inherits it: Serve's proxy then installs the guard, admitting
    # requests by this config (token, body size and deadline) before a replica holds them, on
    # ports of its own (bind_exclusively)
    os.environ.update(proxy_guard_env(config))
    try:  # what the proxy will read, read here first: a bad setting stops us, not the proxy
        Admission.from_env()
    except (OSError, ValueError) as exc:
        refuse(f"proxy guard: {exc}")

    print(f"vae-service: starting Ray and loading '{config.served_name}' ...", flush=True)
    logging_config = _quiet_serve()
    _start_ray()
    try:
        grpc = gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]) if args.grpc_port else None
        http = {"host": args.host, "port": args.port}
        try:  # waits for the proxy, which binds its ports exclusively (proxy_guard.bind_exclusively)
            serve.start(http_options=http, grpc_options=grpc, logging_config=logging_config)
        except RuntimeError as exc:  # another service took a port since check_ports
            bound = re.search(r"Failed to bind to address '([^']+)'", str(exc))
            where = (
                f"{bound[1]}" if bound else f"port {args.port}" + (f" or {args.grpc_port}" if args.grpc_port else "")
            )
            refuse(f"Serve's proxy could not listen on {where}: another service took it; choose another", 1)
        try:
            serve.run(decoder_app(config.model_dump()), name="vae", route_prefix="/")
        except RuntimeError as exc:
            refuse(f"{_start_failure(exc)} (logs: {_logs_dir()})")
        health = serve.get_app_handle("vae").describe.remote().result()
        url = f"http://{args.host}:{args.port}"
        print(banner(config.served_name, health, url, args.grpc_port, token), flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        # Ray then reports its Serve controller's tasks as failed: that is the controller stopping
        print("shutting down (Ray's lines about ServeController tasks failing are it stopping)...", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


def _logs_dir() -> str:
    import ray

    try:
        return str(Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve")
    except Exception:  # a joined cluster: its own node's session
        return "the Ray session's logs/serve/"


def _random_latents(spec: str, seed: int):
    """Seeded standard normal float32 latents of shape `spec` (1x4x32x32), made by NumPy: a demo
    needs no torch (seconds to import)."""
    import numpy as np

    try:
        shape = [int(d) for d in spec.lower().split("x")]
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    except ValueError:  # not numbers, or a negative one
        refuse(f"--random-latents {spec!r}: give a shape like 1x4x32x32", 2)


def _load_latents(args: argparse.Namespace):
    """The latents to send. float64 (NumPy's default) is cast to float32, and said so: the service
    decodes float32, float16 and bfloat16, and a float64 latent's extra bits are lost in any of
    them. Any other dtype the wire does not carry is refused by the client, naming it."""
    if args.random_latents:
        return _random_latents(args.random_latents, args.seed)
    import numpy as np

    from vae_service.batch.latent_files import LatentFileError, load_latents
    from vae_service.storage import redact

    try:
        latents = load_latents(args.latents, args.key)
    except LatentFileError as exc:
        refuse(str(exc), 1)
    if str(latents.dtype) == "float64":  # NumPy's (a torch tensor comes only from bfloat16 files)
        shown = Path(redact(args.latents)).name
        print(f"vae-service: {shown} holds float64 latents: sending them as float32", file=sys.stderr)
        latents = latents.astype(np.float32)
    return latents


def _output_stem(args: argparse.Namespace) -> str:
    """What the outputs are named after: the latents file's name without its suffix (as
    batch-decode names an input's), or `random` for --random-latents."""
    from vae_service.storage import InvalidKey, object_names, redact

    stem = "random" if args.random_latents else Path(args.latents).stem
    try:
        object_names(stem, "png", 1)  # the names' own rule: a plain name, not hidden
    except InvalidKey as exc:
        refuse(f"{redact(args.latents)}: its name cannot name the output files ({exc}); rename it", 2)
    return stem


def cmd_decode(args: argparse.Namespace) -> None:
    from vae_service.storage import object_names
    from vae_service_client import VaeClient, VaeServiceError

    if not args.latents and not args.random_latents:
        refuse("give a latents file (.npy/.safetensors) or --random-latents SHAPE")
    stem = _output_stem(args)
    latents = _load_latents(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fmt = args.format if args.format in VIDEO_OUTPUTS or not args.video else "mp4"  # --video: a video, mp4 unless named
    start = time.perf_counter()
    with VaeClient(args.url, token=os.environ.get("VAE_SERVICE_AUTH_TOKEN")) as client:
        try:
            asked = {"priority": args.priority} if args.priority else {}  # not given: the service's default
            if args.chunks is not None:
                return _decode_session(client, latents, args.chunks, args.quality, fmt, out, stem, start, **asked)
            if args.stream and fmt in VIDEO_OUTPUTS:
                return _write_streamed_video(client, latents, args.quality, out / f"{stem}.{fmt}", start, **asked)
            if args.stream:
                stream = client.decode_frames(latents, args.quality, **asked)
                items = latents.shape[0] if latents.ndim else 1  # a 0-d file: the service refuses it
                return _write_streamed_frames(stream, out, _item_stems(stem, items), start)
            resp = client.decode(latents, args.quality, fmt, height=args.height, width=args.width, **asked)
        except VaeServiceError as exc:  # the service's refusals and the transport's failures, one line each
            refuse(str(exc), 1)
    for name, blob in zip(object_names(stem, fmt, len(resp.output)), resp.output, strict=True):
        (out / name).write_bytes(blob)
    print(
        f"wrote {len(resp.output)} {fmt} file(s) to {out}/ in {time.perf_counter() - start:.2f} s "
        f"(model {resp.model}, {resp.quality}, {resp.precision}, timing {resp.timing})"
    )


def _item_stems(stem: str, items: int) -> list[str]:
    """Each item's file name without its suffix, as its image would be named: `stem` for one item,
    `stem-0`, `stem-1`, ... for several (a streamed frame's name adds `-frame0000` to its item's)."""
    from vae_service.storage import object_names

    return [name.removesuffix(".png") for name in object_names(stem, "png", items)]


def _write_streamed_video(client, latents, quality: str, path: Path, start: float, **asked) -> None:
    """A fragmented MP4 or WebM (its suffix) written to `path` as it decodes (a player can open it
    meanwhile). `asked`: `priority` where the caller gave one."""
    summary = client.decode_video(latents, path, quality, output=path.suffix[1:], **asked)
    print(
        f"wrote {path} as it decoded, in {time.perf_counter() - start:.2f} s "
        f"(model {summary.model}, {summary.quality}, {summary.precision}, timing {summary.timing})"
    )


def _write_streamed_frames(stream, out: Path, item_stems: list[str], start: float) -> None:
    """Each frame as a PNG the moment its chunk arrives ({item stem}-frame0000.png), and a line
    per chunk: a long clip's frames arrive over minutes."""
    written = 0
    for chunk in stream:
        if not written:
            print(f"first frames after {time.perf_counter() - start:.2f} s", flush=True)
        items, frames = chunk.pixels.shape[0], chunk.pixels.shape[chunk.frame_axis]
        for i, item in enumerate(chunk.pixels):
            written += _write_frame_pngs(item, out, item_stems[chunk.item + i], chunk.frame)
        which = f"item {chunk.item}" if items == 1 else f"items {chunk.item}-{chunk.item + items - 1}"
        print(
            f"{which}: frames {chunk.frame}-{chunk.frame + frames - 1} after {time.perf_counter() - start:.2f} s "
            f"({written} frame(s) written)",
            flush=True,
        )
    summary = stream.summary
    print(
        f"wrote {written} streamed frame(s) to {out}/ in {time.perf_counter() - start:.2f} s "
        f"(model {summary.model}, {summary.quality}, {summary.precision}, timing {summary.timing})"
    )


def _write_frame_pngs(frames, out: Path, item_stem: str, first: int) -> int:
    """One item's uint8 frames [t, H, W, 3] as {item stem}-frame{first + i:04d}.png; how many."""
    from PIL import Image

    for t, frame in enumerate(frames):
        Image.fromarray(frame).save(out / f"{item_stem}-frame{first + t:04d}.png")
    return len(frames)


def _decode_session(
    client, latents, chunks: int, quality: str, fmt: str, out: Path, stem: str, start: float, **asked
) -> None:
    """`--chunks N`: a video latent [1, C, T, H, W] sent as chunks of N latent frames through a decode
    session, as a denoiser sends its chunks; each chunk's frames written as PNGs as it is answered (as
    --stream names them), or the mp4/webm file appended to, and a line per chunk. `asked`: `priority`
    where the caller gave one (the session's open carries it)."""
    from vae_service_client.sessions import chunks_of

    parts = list(chunks_of(latents, chunks))  # views; refused here (nothing sent) unless [1, C, T, H, W]
    path = out / f"{stem}.{fmt}" if fmt in VIDEO_OUTPUTS else None
    output = fmt if path else "uint8"
    item_stem = _item_stems(stem, 1)[0]
    dtype = str(latents.dtype).removeprefix("torch.")
    written, part = 0, None
    with client.session(latents.shape[3], latents.shape[4], quality, output, dtype, path=path, **asked) as session:
        for chunk in parts:
            sent = time.perf_counter()
            part = session.decode(chunk)
            ms = (time.perf_counter() - sent) * 1e3
            if part.pixels is not None:
                written += _write_frame_pngs(part.pixels[0], out, item_stem, part.frame)
            what = f"{len(part.fragment or b'')} bytes appended to {path}" if path else f"{written} frame(s) written"
            print(
                f"latent frames {part.latent_frame}-{part.latent_frame + part.latent_frames - 1}: frames "
                f"{part.frame}-{part.frame + part.frames - 1} in {ms:.0f} ms (server decode "
                f"{part.timing.get('decode_ms', 0):.0f} ms; {what})",
                flush=True,
            )
        frames, latent_frames, opened = session.frames, session.latent_frames, session.opened
    where = f"{path} as it decoded" if path else f"{written} frame(s) to {out}/"
    print(
        f"wrote {where}: {frames} frames of {latent_frames} latent frames in {len(parts)} chunk(s), in "
        f"{time.perf_counter() - start:.2f} s (model {opened.get('model')}, {opened.get('quality')}, "
        f"{part.precision if part else opened.get('precision')})"
    )


def cmd_batch_decode(args: argparse.Namespace) -> None:
    config = _config_from(args)
    check_model(config)
    from vae_service.batch import BatchInputError, list_inputs
    from vae_service.storage import LocationError, StoreUnavailable, check_location, redact, scrub

    try:  # every output path, before Ray starts: two inputs that would write one file stop the job here
        check_location(args.output_dir)
        inputs = list_inputs(args.input, args.output)
    except (BatchInputError, LocationError) as exc:
        refuse(str(exc))
    import ray

    from vae_service.batch import run_batch_decode

    started = not ray.is_initialized()
    if started:
        _start_ray()
    _quiet_ray_data()
    gpus = ray.cluster_resources().get("GPU", 0)
    num_gpus = args.num_gpus if args.num_gpus is not None else (1 if gpus else 0)
    concurrency = args.concurrency or (max(1, int(gpus // num_gpus)) if num_gpus else 1)
    print(
        f"decoding {redact(args.input)} -> {redact(args.output_dir)}: {inputs.count} inputs "
        f"({inputs.total_items} latent items), {concurrency} engine(s), {num_gpus} GPU(s) each",
        flush=True,
    )
    try:
        summary = run_batch_decode(
            inputs,
            args.output_dir,
            config,
            quality=args.quality,
            output=args.output,
            priority=args.priority,
            concurrency=concurrency,
            num_gpus=num_gpus,
            progress=sys.stderr,
        )
    except (BatchInputError, ValueError) as exc:
        refuse(str(exc))
    except StoreUnavailable as exc:  # the output's store, before the first input (its stale temporaries)
        refuse(f"the output's store: {exc}", EXIT_ENVIRONMENT)
    finally:
        if started:
            ray.shutdown()
    print(scrub(summary.report()), flush=True)
    if summary.failures:
        sys.exit(1)


def cmd_guard_env(args: argparse.Namespace) -> None:
    """`export` lines for the environment a Serve YAML's cluster needs so that Serve's proxy runs
    the proxy guard with the admission of the YAML's applications (eval them before `serve run`)."""
    import yaml
    from pydantic import ValidationError

    from vae_service.config import ServiceConfig
    from vae_service.serving.wire.proxy_guard import proxy_guard_env

    try:
        raw = yaml.safe_load(Path(args.yaml).read_text())
    except (OSError, yaml.YAMLError) as exc:
        refuse(f"{args.yaml}: {' '.join(str(exc).split())}")
    configs = []
    for app in (raw or {}).get("applications") or []:
        args_ = app.get("args") or {}
        for one in args_.get("models", [args_]) if str(app.get("import_path", "")).endswith("multi_app") else [args_]:
            try:
                configs.append(ServiceConfig.model_validate(one))
            except ValidationError as exc:
                refuse(f"{args.yaml}: application {app.get('name')!r}: {config_errors(exc)}")
    if not configs:
        refuse(f"{args.yaml}: no vae-service applications (applications[].args)")
    for name, value in proxy_guard_env(configs).items():
        print(f"export {name}={shlex.quote(value)}")


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from vae_service.engine import DecodeEngine, DecodeRequest

    engine = DecodeEngine(_config_from(args))
    lat = args.size // engine.spec.spatial_scale
    shape = (
        [args.batch, engine.spec.latent_channels]
        + ([args.frames] if engine.spec.family == "video" else [])
        + [lat, lat]
    )
    prepared = engine.prepare(DecodeRequest(torch.randn(shape), quality=args.quality, output="float"))
    engine.decode([prepared])  # warm-up
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        engine.decode([prepared])
        times.append(time.perf_counter() - t)
    times.sort()
    print(
        f"{engine.spec.name} {shape} {args.quality} {engine.precision} on {engine.device}: "
        f"median {times[len(times) // 2] * 1e3:.1f} ms over {args.repeat}"
    )


class _Help(argparse.HelpFormatter):
    """argparse's, without breaking names at their hyphens (`tiny-` / `flux2` in the preset list)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def main(argv: list[str] | None = None) -> None:
    from vae_service.config import ServiceConfig  # pydantic, no torch: the default model for --help

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of `decode`
    parser = argparse.ArgumentParser(prog="vae-service", description=__doc__, formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, formatter_class=_Help)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            metavar="FILE",
            help="a ServiceConfig as YAML or JSON (limits, batching, fast_path, ...); the flags below override it",
        )
        p.add_argument(
            "--model",
            help=f"a preset ({', '.join(PRESET_NAMES)}: seeded random weights, they decode noise), a local diffusers "
            f"folder, or a hub id (default: {ServiceConfig.model_fields['model'].default})",
        )
        p.add_argument("--precision", help="auto | fp32 | fp16 | bf16 (default: auto)")
        p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: auto)")

    serve_p = command(
        "serve",
        help="start a local Ray (or join RAY_ADDRESS) and serve POST /decode",
        description="Exit status 2: a configuration field or the model is wrong; 1: a port is not free.",
    )
    model_args(serve_p)
    serve_p.add_argument("--host", default="127.0.0.1")
    serve_p.add_argument("--port", type=int, default=8000)
    serve_p.add_argument(
        "--grpc-port", type=int, default=9000, help="0 disables gRPC (Serve's gRPC proxy listens on all interfaces)"
    )
    serve_p.add_argument(
        "--auth-token-file",
        help="file with the bearer token callers must send (default: "
        "$VAE_SERVICE_AUTH_TOKEN; neither: no authentication)",
    )
    serve_p.set_defaults(func=cmd_serve)

    dec = command(
        "decode",
        help="send a latents file to a running service and write images",
        description="float64 latents (NumPy's default) are sent as float32; other dtypes but float32, float16 "
        "and bfloat16 are refused.",
    )
    dec.add_argument("latents", nargs="?", help=".npy or .safetensors file")
    dec.add_argument("--key", help="tensor name inside a .safetensors file")
    dec.add_argument("--random-latents", metavar="SHAPE", help="e.g. 1x4x32x32: send seeded random latents")
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument(
        "--url",
        default=os.environ.get("VAE_SERVICE_URL", "http://127.0.0.1:8000"),
        help="the service (default: $VAE_SERVICE_URL or http://127.0.0.1:8000; bearer token: $VAE_SERVICE_AUTH_TOKEN)",
    )
    dec.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    dec.add_argument("--format", default="png", choices=[*IMAGE_OUTPUTS, *VIDEO_OUTPUTS])
    dec.add_argument("--video", action="store_true", help="ask for mp4 (video models; --format webm for WebM)")
    dec.add_argument(
        "--stream",
        action="store_true",
        help="video models: write each frame as a PNG as soon as it is decoded (with --video or --format "
        "mp4/webm: one video, written as it decodes)",
    )
    dec.add_argument(
        "--chunks",
        type=int,
        metavar="N",
        help="video models: send the latents [1, C, T, H, W] as chunks of N latent frames through a decode "
        "session (WebSocket /sessions), as a denoiser sends them, writing each chunk's frames as PNGs as it is "
        "answered (with --video or --format mp4/webm: one video file, growing by each chunk); a line per chunk",
    )
    dec.add_argument(
        "--priority",
        choices=PRIORITIES,
        help="the scheduler's class to ask for (default: the service's own: interactive for a request, realtime "
        "for a --chunks session); a class above what the deployment lets callers claim is refused",
    )
    dec.add_argument("--height", type=int, help="pixel height, for packed latents")
    dec.add_argument("--width", type=int, help="pixel width, for packed latents")
    dec.add_argument("--out", default="out")
    dec.set_defaults(func=cmd_decode)

    batch_p = command(
        "batch-decode",
        help="decode a folder of latents files or a Parquet dataset on Ray Data (resumable)",
        description="Each .npy/.safetensors file in INPUT is one request's latents (batch dimension first); "
        "a Parquet INPUT has columns `name` and `latents` (one latent per row, no batch dimension). Outputs are "
        "named after their inputs (NAME.png, or NAME-0.png, NAME-1.png, ... for several items); two inputs that "
        "would write one file are refused before anything is decoded; a rerun skips inputs whose outputs exist. "
        "Joins RAY_ADDRESS or starts a local Ray. Exit status 1 when any input failed (each is listed with its "
        "reason), 2 when the job cannot start.",
    )
    model_args(batch_p)
    store = (
        " (or an s3:// or gs:// URI; a store of your own: s3://bucket/prefix?endpoint_override=HOST:PORT&scheme=http)"
    )
    batch_p.add_argument("input", help="folder of .npy/.safetensors latents, or a .parquet file or folder" + store)
    batch_p.add_argument("output_dir", metavar="OUTPUT", help="folder for the decoded files" + store)
    batch_p.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    batch_p.add_argument(
        "--output",
        choices=[*IMAGE_OUTPUTS, *VIDEO_OUTPUTS, "npy"],
        help="default: png for images, mp4 for video models",
    )
    batch_p.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="bulk",
        help="the scheduler's class every item's request carries (default: bulk)",
    )
    batch_p.add_argument(
        "--concurrency", type=int, help="decode engines (actors); default: one per GPU, or 1 without GPUs"
    )
    batch_p.add_argument(
        "--num-gpus", type=float, help="GPUs per engine (default: 1 when the cluster has GPUs, else 0)"
    )
    batch_p.set_defaults(func=cmd_batch_decode)

    bench_p = command("bench", help="time in-process decodes of one model")
    model_args(bench_p)
    bench_p.add_argument("--size", type=int, default=256, help="output pixels per side")
    bench_p.add_argument("--batch", type=int, default=1)
    bench_p.add_argument("--frames", type=int, default=1, help="latent frames (video models)")
    bench_p.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    bench_p.add_argument("--repeat", type=int, default=3)
    bench_p.set_defaults(func=cmd_bench)

    guard_p = command(
        "guard-env",
        help="print the environment that installs the proxy guard for a Serve YAML's applications",
        description='Before `serve run FILE.yaml` (or `ray start` on every node): eval "$(vae-service guard-env '
        "FILE.yaml)\". Serve's proxy then checks the token, body size and body deadline of the YAML's "
        "applications before a replica holds a request, and keeps its ports to itself.",
    )
    guard_p.add_argument("yaml", metavar="FILE.yaml", help="a Serve config whose applications run vae-service")
    guard_p.set_defaults(func=cmd_guard_env)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
