"""Ray DAG composition without Serve: a stand-in denoiser actor hands its latents to a decoder
actor (vae_service.ray.DecoderActor), run as a DAG and as a compiled graph.

    python -m deploy.dag_pipeline --model tiny-kl --seeds 0 1 2 --out out
    python -m deploy.dag_pipeline --model tiny-kl --compiled --out out
    python -m deploy.dag_pipeline --model /path/to/vae --compiled --gpus   # one GPU per actor

Compiled, the latents travel through the graph's own channels: shared memory between actors of
one node, and with `--gpus` (both actors on GPUs) GPU to GPU over the accelerator transport
(`with_tensor_transport()` picks NCCL on CUDA), never through the host. A real pipeline's
denoiser actor returns `pipe(prompt, output_type="latent").images` the same way.

The stand-in denoiser makes deterministic latents from a seed; presets carry seeded random
weights: they decode noise.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import ray
import torch
from ray.dag import InputNode

from vae_service.ray import DecoderActor


@ray.remote
class StandInDenoiser:
    """Latents of a fixed shape from a seed, on the actor's GPU when it has one."""

    def __init__(self, latent_shape: list[int]):
        self.shape = latent_shape
        self.device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"

    def step(self, seed: int) -> torch.Tensor:
        return torch.randn(self.shape, generator=torch.Generator().manual_seed(seed)).to(self.device)


def latent_shape(decoder, pixels: int) -> list[int]:
    """One item of about `pixels` per side, from the geometry the decoder traced."""
    geometry = ray.get(decoder.describe.remote())["geometry"]
    side = max(geometry["min_latent_side"], pixels // geometry["spatial_scale"])
    frames = [geometry.get("min_latent_frames", 1)] if "T" in geometry["latent_layout"] else []
    return [1, geometry["latent_channels"], *frames, side, side]


def build_dag(denoiser, decoder, compiled: bool, **decode_options):
    """seed -> denoiser.step -> decoder.decode; compiled: a compiled graph (teardown() when done)."""
    with InputNode() as seed:
        latents = denoiser.step.bind(seed)
        if compiled:
            latents = latents.with_tensor_transport()  # shared memory on CPU, NCCL between GPUs
        dag = decoder.decode.bind(latents, **decode_options)
    return dag.experimental_compile() if compiled else dag


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-kl", help="preset or local diffusers VAE folder")
    parser.add_argument("--pixels", type=int, default=256, help="output side in pixels")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quality", default="lossless", choices=["lossless", "high", "preview"])
    parser.add_argument("--compiled", action="store_true", help="run as a compiled graph")
    parser.add_argument("--gpus", action="store_true", help="one GPU for each actor")
    parser.add_argument("--out", help="write the decoded images here as PNGs")
    args = parser.parse_args(argv)

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    gpus = {"num_gpus": 1} if args.gpus else {}
    decoder = DecoderActor.options(**gpus).remote({"model": args.model})
    denoiser = StandInDenoiser.options(**gpus).remote(latent_shape(decoder, args.pixels))
    output = "png" if args.out else "uint8"
    dag = build_dag(denoiser, decoder, args.compiled, quality=args.quality, output=output)
    try:
        for seed in args.seeds:
            start = time.perf_counter()
            result = ray.get(dag.execute(seed))
            print(
                f"seed {seed}: {result['model']} {result['quality']} in {(time.perf_counter() - start) * 1e3:.1f} ms "
                f"(decode {result['timing']['decode_ms']:.1f} ms)"
            )
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                Path(args.out, f"seed{seed}.png").write_bytes(result["output"][0])
    finally:
        if args.compiled:
            dag.teardown()
        ray.shutdown()


if __name__ == "__main__":
    main()
