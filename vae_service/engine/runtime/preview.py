"""The `preview` tier: a cheap look at what the latents will decode to, for progress views.

Two ways, chosen per deployment:
- a linear latent-to-RGB map (`rgb = W z + b` per latent pixel, then upsampled to the output size,
  bilinear): microseconds to milliseconds, no weights. `W` and `b` come from the config
  (`preview_rgb_factors`, `preview_rgb_bias`) or, by default, are fitted at start-up to the
  model's own decoder: a few random latents (the model's normalisation applied to N(0, 1), as a
  denoiser's latents are) are decoded, the pixels averaged down to the latent grid, and `W`, `b`
  solved by least squares. That fits any model and weights, presets' random ones included, where
  a published table fits only the published weights.
- a tiny autoencoder (`preview_decoder`: a local diffusers AutoencoderTiny folder such as TAESD),
  decoding each latent frame as an image.

Video previews have the full decode's frame count, handed over one latent frame at a time (each
latent frame's preview repeated over the frames it stands for), so they stream like decodes.

A preview is priced like a decode (engine/pricing/preview_price.py): its working set on one latent frame of the
whole batch (the map's fp32 copies, its RGB and upsampled output, or the tiny decoder's graph),
counted on the meta device at start-up; the cost model adds the latents, the conversion and what
the answer holds. It is never tiled: one that does not fit the bound is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from vae_service.config import ServiceConfig
from vae_service.engine.request.latents import LatentScaling
from vae_service.models import ModelLoadError, ModelSpec, load_vae
from vae_service.models.spec import decoded_pixels, meta_twin

RIDGE = 1e-4  # relative to the mean squared latent: keeps W defined with few calibration pixels
CALIBRATION_SEED = 0


class LinearPreview:
    """rgb = W z + b per latent pixel (W: [C, 3], b: [3]), upsampled by `scale`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, scale: int):
        self.weight, self.bias, self.scale = weight.float(), bias.float(), scale

    def to(self, device: torch.device | str) -> LinearPreview:
        return LinearPreview(self.weight.to(device), self.bias.to(device), self.scale)

    def image(self, z: torch.Tensor) -> torch.Tensor:
        """[n, C, h, w] -> [n, 3, h * scale, w * scale] in the latents' dtype."""
        rgb = torch.einsum("nchw,cr->nrhw", z.float(), self.weight) + self.bias.view(1, 3, 1, 1)
        return F.interpolate(rgb, scale_factor=self.scale, mode="bilinear", align_corners=False).to(z.dtype)


def preview_chunks(
    image: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, counts: list[int]
) -> Iterator[torch.Tensor]:
    """[n, C, T, h, w] -> one [n, 3, counts[t], H, W] chunk per latent frame."""
    for t, count in enumerate(counts):
        frame = image(z[:, :, t])
        yield frame.unsqueeze(2).expand(-1, -1, count, -1, -1)


def fit_linear_preview(
    decode: Callable[[torch.Tensor], torch.Tensor],
    denoiser_latents: torch.Tensor,
    to_decoder: Callable[[torch.Tensor], torch.Tensor],
    scale: int,
) -> LinearPreview:
    """Least squares from decoder-input latent pixels to the decoded pixels averaged over each
    latent pixel's `scale` x `scale` block. `denoiser_latents`: [K, C, (1,) h, w] N(0, 1)."""
    z = to_decoder(denoiser_latents)
    pixels = decode(z).float()
    if z.dim() == 5:  # one frame: the first, which every causal decoder decodes alone
        z, pixels = z[:, :, 0], pixels[:, :, 0]
    target = F.avg_pool2d(pixels, scale)  # [K, 3, h, w]
    x = z.float().permute(0, 2, 3, 1).reshape(-1, z.shape[1]).double()
    y = target.permute(0, 2, 3, 1).reshape(-1, 3).double()
    x_mean, y_mean = x.mean(0), y.mean(0)
    xc = x - x_mean
    gram = xc.T @ xc
    gram += (
        torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device) * RIDGE * gram.diagonal().mean().clamp_min(1e-12)
    )
    weight = torch.linalg.solve(gram, xc.T @ (y - y_mean))
    bias = y_mean - x_mean @ weight
    return LinearPreview(weight.float(), bias.float(), scale)


def calibration_latents(channels: int, video: bool, side: int, dtype: torch.dtype) -> torch.Tensor:
    """Enough N(0, 1) latent pixels to fit C + 1 unknowns per colour several times over."""
    items = max(1, min(16, -(-4 * (channels + 1) // (side * side))))
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    shape = (items, channels, *((1,) if video else ()), side, side)
    return torch.randn(shape, generator=g).to(dtype)


Image = Callable[[torch.Tensor], torch.Tensor]


class Preview:
    """One deployment's preview: `image` maps decoder-input latents [n, C, h, w] to pixels
    [n, 3, H, W]; `scaling` brings request latents to that input (the tiny decoder's own
    normalisation where there is one); `linear` is the map where it is one; `twin` makes the same
    `image` on the meta device (what `preview_price` counts)."""

    def __init__(self, image: Image, scaling, kind: str, linear=None, twin: Callable[[], Image] | None = None):
        self.image, self.scaling, self.kind, self.linear, self.twin = image, scaling, kind, linear, twin

    @classmethod
    def of_linear(cls, linear: LinearPreview, scaling, kind: str) -> Preview:
        return cls(linear.image, scaling, kind, linear, lambda: linear.to("meta").image)

    def chunks(self, z: torch.Tensor, counts: list[int]) -> Iterator[torch.Tensor]:
        return preview_chunks(self.image, z, counts)


def build_preview(
    config: ServiceConfig,
    spec: ModelSpec,
    scaling: LatentScaling,
    device: torch.device,
    decode: Callable[[torch.Tensor], torch.Tensor],
) -> Preview:
    """The deployment's preview: its tiny decoder, its configured map, or a map fitted with
    `decode` (the model's lossless decode of a batch) on `scaling`'s normalisation."""
    scale, dtype = spec.spatial_scale, scaling.dtype
    if config.preview_decoder:
        tiny = load_vae(config.preview_decoder, name="preview")
        found = (tiny.spec.latent_channels, tiny.spec.spatial_scale, tiny.spec.geometry.video_latents)
        if found != (spec.latent_channels, scale, False):
            raise ModelLoadError(
                f"preview_decoder: decodes {found[0]}-channel {'video' if found[2] else 'image'} latents "
                f"at {found[1]}x; model '{spec.name}' needs {spec.latent_channels} channels at {scale}x"
            )
        tiny_vae = torch.nn.Module.to(tiny.vae, device=device, dtype=dtype)

        def twin() -> Image:
            tiny_twin = torch.nn.Module.to(meta_twin(tiny_vae), dtype=dtype).eval()
            return lambda z: decoded_pixels(tiny_twin, z)

        scaling = LatentScaling(tiny.spec, tiny_vae, dtype)
        return Preview(lambda z: decoded_pixels(tiny_vae, z), scaling, "tiny decoder", twin=twin)
    if config.preview_rgb_factors is not None:
        if len(config.preview_rgb_factors) != spec.latent_channels:
            raise ModelLoadError(
                f"preview_rgb_factors: {len(config.preview_rgb_factors)} rows for {spec.latent_channels} "
                f"latent channels of model '{spec.name}'"
            )
        bias = torch.tensor(config.preview_rgb_bias or [0.0, 0.0, 0.0])
        linear = LinearPreview(torch.tensor(config.preview_rgb_factors), bias, scale)
        return Preview.of_linear(linear.to(device), scaling, "linear (configured)")
    geometry = spec.geometry
    z = calibration_latents(spec.latent_channels, geometry.video_latents, max(8, geometry.min_latent_side), dtype)
    if geometry.min_latent_frames > 1:  # a decoder that needs several latent frames: fit on the first
        z = z.expand(-1, -1, geometry.min_latent_frames, -1, -1).contiguous()
    model = scaling.model  # the model's own normalisation, in its pipeline's dtype, then the decode dtype

    def to_decoder(x: torch.Tensor) -> torch.Tensor:
        return model.apply(x.to(model.work_dtype)).to(dtype)

    with torch.inference_mode():
        linear = fit_linear_preview(decode, z.to(device), to_decoder, scale)
    return Preview.of_linear(linear.to(device), scaling, "linear (fitted at start-up)")
