"""Decoder output ([-1, 1] floats, [B,3,H,W] or [B,3,T,H,W]) to the tensor a client gets, or the
pixels an encoder turns into files (engine/encoding.py), and its copy to the host.

uint8 follows diffusers' VaeImageProcessor exactly: (x / 2 + 0.5).clamp(0, 1) * 255, rounded,
computed in fp32, on the decoding device (a quarter of the bytes to copy to the host).

On CUDA the copy goes to pinned host memory. With `pending` the copy is only queued: its event
is appended there and the caller must wait on it before reading the tensor; the device thread
meanwhile queues the next batch (the service waits in a worker thread).
"""

from __future__ import annotations

import torch


def to_uint8(decoded: torch.Tensor) -> torch.Tensor:
    """-> [B, H, W, 3] (image) or [B, T, H, W, 3] (video), uint8, contiguous, on the decoding
    device. In place after the first op: the same arithmetic without a temporary per step."""
    x = decoded.float() / 2
    x.add_(0.5).clamp_(0, 1).mul_(255).round_()
    return x.movedim(1, -1).to(torch.uint8, memory_format=torch.contiguous_format)


def convert(decoded: torch.Tensor, output: str) -> torch.Tensor:
    """`float`: the decoder's output; anything else: uint8 pixels (encoded later). On its device."""
    return decoded if output == "float" else to_uint8(decoded)


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


def postprocess(decoded: torch.Tensor, output: str, pending: list | None = None) -> torch.Tensor:
    return to_host(convert(decoded, output), pending)
