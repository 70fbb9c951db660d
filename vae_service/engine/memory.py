"""Peak decode memory, per model and shape, measured once without decoding anything: the model's
decoder runs on the meta device (shapes only, no data, no compute) while a dispatch mode counts
the bytes of live tensor storage. Both numbers are linear in latent pixels (measured: equal per
pixel from 8x8 to 60x104 latents for SD, Wan2.1 and the tiny presets), so one run at a small
size gives them for every size:

- `working`: the peak while decoding one item (one latent frame at a time for the causal walk,
  its causal history included; per latent frame for video decoders that take a clip at once);
- `resident`: what a video decode holds between chunks (the causal history), which every tile of
  a tiled decode keeps at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vae_service.models.spec import ModelSpec

CALIBRATION_LATENT = 16  # latent pixels per side of the measuring run
CALIBRATION_FRAMES = 3  # latent frames (video): the first chunk and two steady ones


class LiveBytes(TorchDispatchMode):
    """Bytes of storage held by tensors that ops created and that are still referenced."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.sizes:
            self.sizes[key], self.refs[key] = storage.nbytes(), 0
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.current -= self.sizes.pop(key)


@dataclass(frozen=True)
class MemoryModel:
    working_per_latent_px: float  # bytes, one item (and one latent frame when `per_latent_frame`)
    resident_per_latent_px: float  # bytes, one item (0 for images)
    dtype_bytes: int
    video: bool  # decoded through engine/video.py: frames converted as they come
    scale: int  # output pixels per latent pixel, per side
    per_latent_frame: bool = False  # the decoder takes the whole clip at once

    def working(self, items: int, h: int, w: int, latent_frames: int = 1) -> int:
        frames = latent_frames if self.per_latent_frame else 1
        return int(items * self.working_per_latent_px * h * w * frames)

    def resident(self, items: int, h: int, w: int) -> int:
        return int(items * self.resident_per_latent_px * h * w)

    def answer(self, output_pixels: int, output: str) -> int:
        """What the answer holds: video keeps converted frames only (chunks are converted as they
        come); an image holds the decoder's output, its fp32 conversion and the uint8 pixels."""
        kept = 3 * (self.dtype_bytes if output == "float" else 1)
        return output_pixels * (kept if self.video else kept + 3 * self.dtype_bytes + 12)


def measure(
    twin: nn.Module,
    dtype: torch.dtype,
    spec: ModelSpec,
    decode: Callable[[nn.Module, torch.Tensor], Iterator[torch.Tensor]],
) -> MemoryModel:
    """`twin`: the model on the meta device; `decode(twin, z)` yields the decode's output chunks
    (one for images), each dropped at once as the engine converts or streams them."""
    meta_vae = nn.Module.to(twin, dtype=dtype).eval()
    geometry = spec.geometry
    side = max(CALIBRATION_LATENT, geometry.min_latent_side)
    video, chunked = geometry.video_latents, spec.path == "causal_walk"
    latent_frames = 1 if spec.family == "image" else max(CALIBRATION_FRAMES, geometry.min_latent_frames)
    frames = (latent_frames,) if video else ()
    z = torch.empty(1, geometry.latent_channels, *frames, side, side, device="meta", dtype=dtype)
    live, resident = LiveBytes(), 0
    with torch.inference_mode(), live:
        for out in decode(meta_vae, z):
            del out
            resident = max(resident, live.current)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_frame = video and not chunked
    working = live.peak / side**2 / (latent_frames if per_frame else 1)
    return MemoryModel(
        working, resident / side**2 if chunked else 0.0, itemsize, video, geometry.spatial_scale, per_frame
    )
