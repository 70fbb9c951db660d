"""`vae-service serve | decode | batch-decode | bench`: the only place that parses argv."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from vae_service.config import ServiceConfig

log = logging.getLogger("vae_service")


def _read_config_file(path: str) -> dict:
    """A ServiceConfig as YAML or JSON (JSON is YAML too)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        sys.exit(f"--config {path}: {exc}")
    if not isinstance(data, dict):
        sys.exit(f"--config {path}: must hold a map of ServiceConfig fields")
    return data


def _config_from(args: argparse.Namespace) -> ServiceConfig:
    """--config FILE first, then the flags that were given on top of it."""
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
        sys.exit(f"invalid configuration:\n{exc}")


def example_command(url: str, latent_shape: str) -> str:
    """A decode call a user can paste into a new shell: this interpreter by its absolute path (the
    `vae-service` script is only on the PATH inside the virtual environment)."""
    python = shlex.quote(sys.executable)
    return f"{python} -m vae_service.cli decode --url {url} --random-latents {latent_shape} --out out"


def _example_shape(health: dict) -> str:
    """Latents of about 128 px for the served model (a few seconds even for the full-size presets
    on a 2-core CPU), from the geometry its replica traced."""
    geometry = health["geometry"]
    side = max(geometry["min_latent_side"], 128 // geometry["spatial_scale"])
    frames = geometry.get("min_latent_frames", 1)
    return "x".join(map(str, [1, geometry["latent_channels"], *([frames] if frames > 1 else []), side, side]))


def _warn_about_exposure(config: ServiceConfig, host: str, grpc_port: int) -> None:
    from vae_service.serving.admission import load_token

    if load_token(config.auth_token_file):
        return
    banner = "!" * 78
    if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        log.warning(
            "\n%s\n!! No bearer token configured and HTTP listens on %s: anyone who reaches this host "
            "can decode.\n!! Set VAE_SERVICE_AUTH_TOKEN or --auth-token-file, and put TLS in front.\n%s",
            banner,
            host,
            banner,
        )
    if grpc_port:
        log.warning(
            "\n%s\n!! Ray Serve 2.60's gRPC proxy listens on ALL interfaces (port %d) whatever --host "
            "says, and no bearer token is configured.\n!! Set a token, or --grpc-port 0 to turn gRPC "
            "off.\n%s",
            banner,
            grpc_port,
            banner,
        )


def cmd_serve(args: argparse.Namespace) -> None:
    config = _config_from(args)
    _warn_about_exposure(config, args.host, args.grpc_port)
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from vae_service.serving.admission import Admission
    from vae_service.serving.app import GRPC_SERVICER, decoder_app
    from vae_service.serving.proxy_guard import proxy_guard_env

    # a local Ray started below inherits it: Serve's proxy then installs the guard, admitting
    # requests by this config (token, body size and deadline) before a replica holds them
    os.environ.update(proxy_guard_env(config))
    try:  # what the proxy will read, read here first: a bad setting stops us, not the proxy
        Admission.from_env()
    except (OSError, ValueError) as exc:
        sys.exit(f"proxy guard: {exc}")

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    grpc = gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]) if args.grpc_port else None
    serve.start(http_options={"host": args.host, "port": args.port}, grpc_options=grpc)
    serve.run(decoder_app(config.model_dump()), name="vae", route_prefix="/")
    url = f"http://{args.host}:{args.port}"
    print(f"\nvae-service is serving '{config.served_name}' at {url}  (POST /decode, POST /remote-decode, GET /health)")
    if args.grpc_port:
        print(f"gRPC vae_service.v1.VaeDecoder at {args.host}:{args.grpc_port} (metadata application=vae)")
    print("Try it (random latents -> PNGs in ./out):")
    example = _example_shape(serve.get_app_handle("vae").describe.remote().result())
    print(f"  {example_command(url, example)}\n")
    print("Ctrl-C to stop.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("shutting down...", flush=True)
        serve.shutdown()
        ray.shutdown()


def _load_latents(args: argparse.Namespace):
    import torch

    from vae_service.batch.latent_files import LatentFileError, load_latents

    if args.random_latents:
        shape = [int(d) for d in args.random_latents.lower().split("x")]
        return torch.randn(shape, generator=torch.Generator().manual_seed(args.seed))
    try:
        return load_latents(args.latents, args.key)
    except LatentFileError as exc:
        sys.exit(str(exc))


def cmd_decode(args: argparse.Namespace) -> None:
    from vae_service_client import VaeClient, VaeServiceError

    if not args.latents and not args.random_latents:
        sys.exit("give a latents file (.npy/.safetensors) or --random-latents SHAPE")
    latents = _load_latents(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fmt = "mp4" if args.video else args.format
    start = time.perf_counter()
    with VaeClient(args.url, token=os.environ.get("VAE_SERVICE_AUTH_TOKEN")) as client:
        try:
            if args.stream:
                return _write_streamed_frames(client.decode_frames(latents, args.quality), out, start)
            resp = client.decode(latents, args.quality, fmt, height=args.height, width=args.width)
        except VaeServiceError as exc:
            sys.exit(str(exc))
    for i, blob in enumerate(resp.output):
        (out / f"{i:03d}.{fmt}").write_bytes(blob)
    print(
        f"wrote {len(resp.output)} {fmt} file(s) to {out}/ in {time.perf_counter() - start:.2f} s "
        f"(model {resp.model}, {resp.quality}, {resp.precision}, timing {resp.timing})"
    )


def _write_streamed_frames(stream, out: Path, start: float) -> None:
    """Each frame as a PNG the moment its chunk arrives: item{i}_frame{f}.png."""
    from PIL import Image

    written = 0
    for chunk in stream:
        if not written:
            print(f"first frames after {time.perf_counter() - start:.2f} s", flush=True)
        for i, item in enumerate(chunk.pixels):
            for t, frame in enumerate(item):
                Image.fromarray(frame).save(out / f"item{chunk.item + i:02d}_frame{chunk.frame + t:04d}.png")
                written += 1
    summary = stream.summary
    print(
        f"wrote {written} streamed frame(s) to {out}/ in {time.perf_counter() - start:.2f} s "
        f"(model {summary.model}, {summary.quality}, {summary.precision}, timing {summary.timing})"
    )


def cmd_batch_decode(args: argparse.Namespace) -> None:
    config = _config_from(args)
    import ray

    from vae_service.batch import BatchInputError, run_batch_decode

    started = not ray.is_initialized()
    if started:
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False  # the job shows its own
    gpus = ray.cluster_resources().get("GPU", 0)
    num_gpus = args.num_gpus if args.num_gpus is not None else (1 if gpus else 0)
    concurrency = args.concurrency or (max(1, int(gpus // num_gpus)) if num_gpus else 1)
    print(f"decoding {args.input} -> {args.output_dir}: {concurrency} engine(s), {num_gpus} GPU(s) each", flush=True)
    try:
        summary = run_batch_decode(
            args.input,
            args.output_dir,
            config,
            quality=args.quality,
            output=args.output,
            concurrency=concurrency,
            num_gpus=num_gpus,
            progress=sys.stderr,
        )
    except (BatchInputError, ValueError) as exc:
        sys.exit(str(exc))
    finally:
        if started:
            ray.shutdown()
    print(summary.report(), flush=True)
    if summary.failures:
        sys.exit(1)


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


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="vae-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            metavar="FILE",
            help="a ServiceConfig as YAML or JSON (limits, batching, fast_path, ...); the flags below override it",
        )
        p.add_argument(
            "--model",
            help="preset (sd, sdxl, flux, wan2.1, tiny-kl, tiny-wan), local diffusers folder, "
            f"or hub id (default: {ServiceConfig.model_fields['model'].default})",
        )
        p.add_argument("--precision", help="auto | fp32 | fp16 | bf16 (default: auto)")
        p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: auto)")

    serve_p = sub.add_parser("serve", help="start a local Ray (or join RAY_ADDRESS) and serve POST /decode")
    model_args(serve_p)
    serve_p.add_argument("--host", default="127.0.0.1")
    serve_p.add_argument("--port", type=int, default=8000)
    serve_p.add_argument("--grpc-port", type=int, default=9000, help="0 disables gRPC")
    serve_p.add_argument(
        "--auth-token-file",
        help="file with the bearer token callers must send (default: "
        "$VAE_SERVICE_AUTH_TOKEN; neither: no authentication)",
    )
    serve_p.set_defaults(func=cmd_serve)

    dec = sub.add_parser("decode", help="send a latents file to a running service and write images")
    dec.add_argument("latents", nargs="?", help=".npy or .safetensors file")
    dec.add_argument("--key", help="tensor name inside a .safetensors file")
    dec.add_argument("--random-latents", metavar="SHAPE", help="e.g. 1x4x32x32: send seeded random latents")
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the service (bearer token: $VAE_SERVICE_AUTH_TOKEN)"
    )
    dec.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    dec.add_argument("--format", default="png", choices=["png", "jpeg"])
    dec.add_argument("--video", action="store_true", help="ask for mp4 (video models)")
    dec.add_argument(
        "--stream", action="store_true", help="video models: write each frame as a PNG as soon as it is decoded"
    )
    dec.add_argument("--height", type=int, help="pixel height, for packed latents")
    dec.add_argument("--width", type=int, help="pixel width, for packed latents")
    dec.add_argument("--out", default="out")
    dec.set_defaults(func=cmd_decode)

    batch_p = sub.add_parser(
        "batch-decode",
        help="decode a folder of latents files or a Parquet dataset on Ray Data (resumable)",
        description="Each .npy/.safetensors file in INPUT is one request's latents (batch dimension first); "
        "a Parquet INPUT has columns `name` and `latents` (one latent per row, no batch dimension). Outputs are "
        "named after their inputs; a rerun skips inputs whose outputs exist. Joins RAY_ADDRESS or starts a "
        "local Ray. Exit status 1 when any input failed (each is listed with its reason).",
    )
    model_args(batch_p)
    batch_p.add_argument("input", help="folder of .npy/.safetensors latents, or a .parquet file or folder")
    batch_p.add_argument("output_dir", metavar="OUTPUT", help="folder for the decoded files")
    batch_p.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    batch_p.add_argument(
        "--output", choices=["png", "jpeg", "mp4", "npy"], help="default: png for images, mp4 for video models"
    )
    batch_p.add_argument(
        "--concurrency", type=int, help="decode engines (actors); default: one per GPU, or 1 without GPUs"
    )
    batch_p.add_argument(
        "--num-gpus", type=float, help="GPUs per engine (default: 1 when the cluster has GPUs, else 0)"
    )
    batch_p.set_defaults(func=cmd_batch_decode)

    bench_p = sub.add_parser("bench", help="time in-process decodes of one model")
    model_args(bench_p)
    bench_p.add_argument("--size", type=int, default=256, help="output pixels per side")
    bench_p.add_argument("--batch", type=int, default=1)
    bench_p.add_argument("--frames", type=int, default=1, help="latent frames (video models)")
    bench_p.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    bench_p.add_argument("--repeat", type=int, default=3)
    bench_p.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
