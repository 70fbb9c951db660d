"""Decoder output ([-1, 1] floats, [B,3,H,W] or [B,3,T,H,W]) to the tensor a client gets, or the
pixels an encoder turns into files (engine/media/encoding.py), and its copy to the host.

uint8 follows diffusers' VaeImageProcessor exactly: (x / 2 + 0.5).clamp(0, 1) * 255, rounded,
computed in fp32, on the decoding device (a quarter of the bytes to copy to the host). Decoders
whose pixels are not in [-1, 1] say so in the catalog (`pixels`): ImageNet-normalised ones
(MiniMax-H3, whose pipeline maps them back with ImageNet's mean and std).

On CUDA the copy goes to pinned host memory. With `pending` the copy is only queued: its event
is appended there and the caller must wait on it before reading the tensor; the device thread
meanwhile queues the next batch (the service waits in a worker thread).
"""

from __future__ import annotations

import torch

from vae_service.models.catalog import IMAGENET_MEAN, IMAGENET_STD, PixelRange


def _unit(decoded: torch.Tensor, pixels: PixelRange) -> torch.Tensor:
    """The decoder's pixels in [0, 1] (before clamping), as a new fp32 tensor."""
    if pixels == "signed":
        return (decoded.float() / 2).add_(0.5)
    shape = (1, 3) + (1,) * (decoded.dim() - 2)
    std = torch.tensor(IMAGENET_STD, device=decoded.device).view(shape)
    return (decoded.float() * std).add_(torch.tensor(IMAGENET_MEAN, device=decoded.device).view(shape))


def to_uint8(decoded: torch.Tensor, pixels: PixelRange = "signed") -> torch.Tensor:
    """-> [B, H, W, 3] (image) or [B, T, H, W, 3] (video), uint8, contiguous, on the decoding
    device. In place after the first op: the same arithmetic without a temporary per step."""
    x = _unit(decoded, pixels)
    x.clamp_(0, 1).mul_(255).round_()
    return x.movedim(1, -1).to(torch.uint8, memory_format=torch.contiguous_format)


def pixel_form(output: str) -> str:
    """What `convert` makes for an output: `float` keeps the decoder's output, every other output
    (raw uint8 or a file encoded later) is `uint8` pixels."""
    return "float" if output == "float" else "uint8"


def convert(decoded: torch.Tensor, output: str, pixels: PixelRange = "signed") -> torch.Tensor:
    """`float`: the decoder's output; anything else: uint8 pixels (encoded later). On its device."""
    return decoded if pixel_form(output) == "float" else to_uint8(decoded, pixels)


def to_host(x: torch.Tensor, pending: list | None = None) -> torch.Tensor:
    if not x.is_cuda:
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    if pending is None:
        torch.cuda.current_stream(x.device).synchronize()
    else:
        event = torch.cuda.Event()
        event.record()
        pending.append(event)
    return host


def postprocess(
    decoded: torch.Tensor, output: str, pending: list | None = None, pixels: PixelRange = "signed"
) -> torch.Tensor:
    return to_host(convert(decoded, output, pixels), pending)
