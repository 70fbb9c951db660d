"""What a decode session is asked for and what can go wrong with it: the open request (the settings
every chunk of the session shares), a chunk as the engine checks it, and the session's own errors.

A session is the causal walk's state (engine/runtime/wan_walk.py) made to outlive one request: the
denoiser sends latent chunks [1, C, t, H, W] in order, each decoded at once, continuing the clip the
chunks before it began (engine/execution/session.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vae_service.engine.request.decode_request import MAX_ID_CHARS, QUALITIES, VIDEO_OUTPUTS
from vae_service.engine.request.errors import DecodeError, InvalidInput, LimitExceeded
from vae_service.names import PRIORITIES

SESSION_OUTPUTS = ("uint8", "float", *VIDEO_OUTPUTS)  # frames, or one fragmented file across all chunks
SESSION_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Bounds checked at open, before the engine prices anything (the deployment's own limits, pixels and
# memory, are the engine's: DecodeEngine.open_session). A latent side of 2**16 is 524288 pixels at
# spatial scale 8, far past any decoder's memory: the bound only keeps every size torch is asked
# about (a meta tensor, a price) far from int64's. The clip's length is a hint that costs nothing,
# bounded at 2**20 latent frames (Wan: 4,194,301 frames, 48 hours at 24 fps).
MAX_LATENT_SIDE = 2**16
MAX_CLIP_LATENT_FRAMES = 2**20


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
    priority: str | None = None  # the scheduler's class for its chunks (names.PRIORITIES); None: realtime

    def __post_init__(self) -> None:
        """Every setting's type and bounds, naming the field: 400 invalid_request, or 413
        payload_too_large for a size past MAX_LATENT_SIDE."""
        for key, top, what in (
            ("height", MAX_LATENT_SIDE, "the latents' height"),
            ("width", MAX_LATENT_SIDE, "the latents' width"),
            ("clip_latent_frames", MAX_CLIP_LATENT_FRAMES, "the clip's length in latent frames"),
        ):
            value = getattr(self, key)
            if key == "clip_latent_frames" and value is None:
                continue
            if type(value) is not int or value < 1:
                raise InvalidInput(key, f"{what}: a positive integer (at most {top}), got {_shown(value)}")
            if value > top:
                error = LimitExceeded if key != "clip_latent_frames" else InvalidInput
                raise error(key, f"{what}: at most {top}, got {_shown(value)}")
        _check_choice("quality", self.quality, QUALITIES, "a session decodes")
        _check_choice("output", self.output, SESSION_OUTPUTS, "a session answers")
        _check_choice("dtype", self.dtype, tuple(SESSION_DTYPES), "the chunks' dtype is one of")
        if self.priority is not None:
            _check_choice("priority", self.priority, PRIORITIES, "a session's chunks are scheduled as")
        if type(self.latents_scaled) is not bool:
            raise InvalidInput("latents_scaled", f"must be true or false, got {_shown(self.latents_scaled)}")
        for key in ("scaling_factor", "shift_factor"):
            object.__setattr__(self, key, _check_factor(key, getattr(self, key), self.dtype))
        for key in ("model", "request_id"):
            value = getattr(self, key)
            if value is not None and (type(value) is not str or len(value) > MAX_ID_CHARS):
                got = f"{len(value)} characters" if isinstance(value, str) else _shown(value)
                raise InvalidInput(key, f"a string of at most {MAX_ID_CHARS} characters, got {got}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return SESSION_DTYPES[self.dtype]


def _shown(value: object) -> str:
    """A refused value in a message, never longer than a line."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}... ({type(value).__name__})"


def _check_choice(key: str, value: object, allowed: tuple[str, ...], what: str) -> None:
    if type(value) is not str or value not in allowed:
        raise InvalidInput(key, f"{what} {list(allowed)}, not {_shown(value)}")


def _check_factor(key: str, value: object, dtype: str) -> float | None:
    """A factor given as a number: finite, non-zero for the scaling, and within what the chunks'
    dtype holds: |shift| and |scaling| at most its largest value, and 1 / |scaling| too (a chunk is
    divided by it: past that every latent of 1 or more divides to infinity, and every chunk fails)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(key, f"a number or nil, got {_shown(value)}")
    if isinstance(value, int) and abs(value) > 2**1023:  # past every float: math.isfinite would overflow
        value = math.inf
    if not math.isfinite(value):
        raise InvalidInput(key, f"must be a finite number, got {value!r}")
    if key == "scaling_factor" and value == 0:
        raise InvalidInput(key, "must not be 0")
    top = torch.finfo(SESSION_DTYPES[dtype]).max
    if abs(value) > top:
        raise InvalidInput(key, f"|{key}| is at most {top:.6g} (the largest {dtype}), got {value!r}")
    if key == "scaling_factor" and 1 / abs(value) > top:
        raise InvalidInput(
            key,
            f"|scaling_factor| is at least {1 / top:.6g} (1 / the largest {dtype}: the chunks are divided by it), "
            f"got {value!r}",
        )
    return float(value)


class SessionExpired(DecodeError):
    """The session was idle longer than `sessions.idle_timeout_s` (or closed) and its state is gone.
    `last_frame`: the frames it had decoded (the next frame a new session would have to produce)."""

    def __init__(self, field: str, message: str, frames: int = 0, latent_frames: int = 0):
        super().__init__(field, message)
        self.frames, self.latent_frames = frames, latent_frames


class SessionLost(DecodeError):
    """The replica that held the session is gone (killed, restarted, scaled down): its causal cache
    with it. The client can resume by replaying the session's latents in a new one."""


class SessionMoved(DecodeError):
    """The session is leaving this replica (it drains: a scale-down, a rolling update): its state
    went to the cluster's session keeper, and the client continues it on another replica by attaching
    to the same id (the client libraries do so by themselves); nothing was applied here."""
