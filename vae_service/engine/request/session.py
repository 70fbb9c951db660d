"""What a decode session is asked for and what can go wrong with it: the open request (the settings
every chunk of the session shares), a chunk as the engine checks it, and the session's own errors.

A session is the causal walk's state (engine/runtime/wan_walk.py) made to outlive one request: the
denoiser sends latent chunks [1, C, t, H, W] in order, each decoded at once, continuing the clip the
chunks before it began (engine/execution/session.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vae_service.engine.request.decode_request import QUALITIES, VIDEO_OUTPUTS
from vae_service.engine.request.errors import DecodeError, InvalidInput

SESSION_OUTPUTS = ("uint8", "float", *VIDEO_OUTPUTS)  # frames, or one fragmented file across all chunks
SESSION_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class SessionOpen:
    """The settings of a session, fixed at open. `height`/`width` are the latents' (the frames are
    `spatial_scale` times larger); `dtype` the chunks' wire dtype. The factors as /decode takes
    them: absent for the model's own, a number to replace it, `latents_scaled` when the chunks are
    already unscaled. `clip_latent_frames`: the clip's length in latent frames where the denoiser
    knows it (a hint, never a bound): on CPU the chunks' post-quant conv then runs on the kernel torch
    picks for the whole clip, whose bits differ from a short chunk's past C * T * H = 20480 (Wan 2.1
    at 480p: clips of over 21 latent frames); without it such a long clip's session frames are within
    the last bits of the whole decode, not equal (wan_walk.chunk_post_quant)."""

    height: int
    width: int
    quality: str = "lossless"
    output: str = "uint8"
    dtype: str = "float32"
    scaling_factor: float | None = None
    shift_factor: float | None = None
    latents_scaled: bool = False
    model: str | None = None
    request_id: str | None = None
    clip_latent_frames: int | None = None

    def __post_init__(self) -> None:
        for key in ("height", "width", "clip_latent_frames"):
            value = getattr(self, key)
            if key == "clip_latent_frames" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(key, f"the latents' {key}: a positive integer, got {value!r}")
        if self.quality not in QUALITIES:
            raise InvalidInput("quality", f"{self.quality!r} is not one of {list(QUALITIES)}")
        if self.output not in SESSION_OUTPUTS:
            raise InvalidInput("output", f"a session answers {list(SESSION_OUTPUTS)}, not {self.output!r}")
        if self.dtype not in SESSION_DTYPES:
            raise InvalidInput("dtype", f"{self.dtype!r} is not one of {list(SESSION_DTYPES)}")
        for key in ("scaling_factor", "shift_factor"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise InvalidInput(key, f"a number or nil, got {value!r}")
        if self.scaling_factor == 0:
            raise InvalidInput("scaling_factor", "must not be 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return SESSION_DTYPES[self.dtype]


class SessionExpired(DecodeError):
    """The session was idle longer than `sessions.idle_timeout_s` (or closed) and its state is gone.
    `last_frame`: the frames it had decoded (the next frame a new session would have to produce)."""

    def __init__(self, field: str, message: str, frames: int = 0, latent_frames: int = 0):
        super().__init__(field, message)
        self.frames, self.latent_frames = frames, latent_frames


class SessionLost(DecodeError):
    """The replica that held the session is gone (killed, restarted, scaled down): its causal cache
    with it. The client can resume by replaying the session's latents in a new one."""
