"""Decoder output ([-1, 1] floats, [B,3,H,W] or [B,3,T,H,W]) to what the client asked for.

uint8 follows diffusers' VaeImageProcessor exactly: (x / 2 + 0.5).clamp(0, 1) * 255, rounded,
computed in fp32.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

JPEG_QUALITY = 95
MP4_FPS = 16


def to_uint8(decoded: torch.Tensor) -> torch.Tensor:
    """-> [B, H, W, 3] (image) or [B, T, H, W, 3] (video), uint8, contiguous, on the CPU. In place
    after the first op: the same arithmetic without a temporary per step."""
    x = decoded.float() / 2
    x.add_(0.5).clamp_(0, 1).mul_(255).round_()
    return x.movedim(1, -1).to(torch.uint8, memory_format=torch.contiguous_format).cpu()


def _encode_image(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG")
    else:
        Image.fromarray(pixels).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def _encode_mp4(frames: np.ndarray, fps: int = MP4_FPS) -> bytes:
    import av  # imported lazily: only video deployments need it

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def postprocess(decoded: torch.Tensor, output: str) -> torch.Tensor | list[bytes]:
    if output == "float":
        return decoded.cpu()
    pixels = to_uint8(decoded)
    if output == "uint8":
        return pixels
    arrays = pixels.numpy()
    if output == "mp4":
        return [_encode_mp4(item) for item in arrays]
    if arrays.ndim == 5:  # single-frame video (validated upstream)
        arrays = arrays[:, 0]
    return [_encode_image(item, output) for item in arrays]
