"""Serve composition: a stand-in denoiser hands its latents to the decode deployment through a
handle instead of calling `vae.decode`.

    serve run deploy.pipeline_app:app          # POST /generate {"seed": 1, "height": 256, "width": 256}

A real diffusers pipeline does the same with `output_type="latent"`:

    latents = pipe(prompt, output_type="latent").images          # still scaled, on the GPU
    result = await decoder.decode.remote(latents.cpu(), output="png")
    png_bytes = result["output"][0]

The stand-in denoiser makes deterministic latents from a seed; the decoder is the `sd` preset
(seeded random weights: it decodes noise).
"""

import torch
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from vae_service.serving.app import build_decoder

api = FastAPI(title="pipeline demo")


class GenerateRequest(BaseModel):
    seed: int = 0
    height: int = Field(256, ge=8, le=2048, multiple_of=8)
    width: int = Field(256, ge=8, le=2048, multiple_of=8)
    quality: str = "lossless"


@serve.deployment(name="Denoiser")
@serve.ingress(api)
class Denoiser:
    def __init__(self, decoder: DeploymentHandle, latent_channels: int = 4):
        self.decoder = decoder
        self.latent_channels = latent_channels

    def denoise(self, req: GenerateRequest) -> torch.Tensor:
        gen = torch.Generator().manual_seed(req.seed)
        return torch.randn(1, self.latent_channels, req.height // 8, req.width // 8, generator=gen)

    @api.post("/generate")
    async def generate(self, req: GenerateRequest) -> Response:
        result = await self.decoder.decode.remote(self.denoise(req), quality=req.quality, output="png")
        return Response(
            result["output"][0], media_type="image/png", headers={"x-decode-ms": str(result["timing"]["decode_ms"])}
        )


def build(args: dict | None = None) -> serve.Application:
    args = dict(args or {})
    decoder_args = args.pop("decoder", {"model": "sd"})
    return Denoiser.bind(build_decoder(decoder_args), **args)


app = build()
