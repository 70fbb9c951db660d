"""What the engine decodes: latents plus plain fields, checked on construction so that every way
in (msgpack, gRPC, Hugging Face remote-decode, handles, in-process callers) shares one set of
rules and one set of messages. Checks against the model (channels, budgets) are the engine's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from difflib import get_close_matches

import torch

from vae_service.engine.request.errors import InvalidInput
from vae_service.names import IMAGE_OUTPUTS, PRIORITIES, VIDEO_OUTPUTS

QUALITIES = ("lossless", "high", "preview")
OUTPUTS = ("uint8", "float", *IMAGE_OUTPUTS, *VIDEO_OUTPUTS)
# "auto": tiled above the memory bound (`high` in spatial tiles, `lossless` by the class's own tiled
# decode); "model": `lossless` through the class's own tiled decode whatever the bound, as
# `vae.enable_tiling(); vae.decode` (a caller mirroring a local VAE with tiling on); "none": never
# tiled, refused (413) where the whole decode does not fit (a caller mirroring one without)
TILINGS = ("auto", "model", "none")
LATENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_LATENT_DIMS = 6
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class DecodeRequest:
    latents: torch.Tensor  # [B, C, H, W], [B, C, T, H, W] or packed [B, L, C*4]; float32/float16/bfloat16
    quality: str = "lossless"
    output: str = "uint8"
    # latent normalisation: by default the model's own; a factor given replaces the model's
    # (`z / scaling + shift`); `latents_scaled`: the latents are already scaled, so a factor not
    # given is skipped instead (gRPC's field of that name; nil for a factor over msgpack)
    scaling_factor: float | None = None
    shift_factor: float | None = None
    latents_scaled: bool = False
    height: int | None = None  # pixels; required for packed latents
    width: int | None = None
    request_id: str | None = None
    model: str | None = None  # when given, must name the served model
    stream: bool = False  # video: frames handed over chunk by chunk as they are decoded
    decode_timestep: float | None = None  # timestep-conditioned decoders (LTX); None: the pipeline's default
    tiling: str = "auto"  # TILINGS; honoured by engine/planning/planner.py's plan_request
    # object storage (the serving layer's: serving/outputs/sinks.py): a configured sink's name and the key its
    # files go under; the engine decodes and encodes as without them
    sink: str | None = None
    key: str | None = None
    # the scheduler's class (PRIORITIES); None: the surface's default. Which classes a caller may
    # claim is the deployment's to say (serving/scheduling/classes.py); the engine decodes alike
    priority: str | None = None

    def __post_init__(self) -> None:
        _check_latents(self.latents)
        _check_choice("quality", self.quality, QUALITIES)
        _check_choice("output", self.output, OUTPUTS)
        _check_choice("tiling", self.tiling, TILINGS)
        if self.priority is not None:
            _check_choice("priority", self.priority, PRIORITIES)
        if self.tiling == "model" and self.quality != "lossless":
            raise InvalidInput(
                "tiling",
                f"'model' (the model class's own tiled decode) is a 'lossless' decode; quality is {self.quality!r}",
            )
        for key, nonzero in (("scaling_factor", True), ("shift_factor", False)):
            object.__setattr__(self, key, _factor(key, getattr(self, key), nonzero))
        if self.decode_timestep is not None:
            object.__setattr__(self, "decode_timestep", _factor("decode_timestep", self.decode_timestep, False))
        for key in ("height", "width"):
            value = getattr(self, key)
            if value is not None and (type(value) is not int or value <= 0):
                raise InvalidInput(key, f"must be a positive int, got {value!r}")
        for key in ("stream", "latents_scaled"):
            if type(getattr(self, key)) is not bool:
                raise InvalidInput(key, f"must be true or false, got {getattr(self, key)!r}")
        for key in ("request_id", "model", "sink"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
                raise InvalidInput(key, f"must be a string of at most {MAX_ID_CHARS} characters")
        _check_sink(self)

    @property
    def items(self) -> int:
        return self.latents.shape[0]


def _check_sink(request: DecodeRequest) -> None:
    """A sink and a key come together, for encoded files, answered whole; the key's form and the
    sink's name are the serving layer's to check (vae_service/storage/keys.py, the config's sinks)."""
    if request.sink is None and request.key is None:
        return
    if request.sink is None:
        raise InvalidInput("sink", "is required with `key` (the name of one of the deployment's sinks)")
    if request.key is None:
        raise InvalidInput("key", f"is required with `sink`: the object name its files get under sink {request.sink!r}")
    if not isinstance(request.key, str):
        raise InvalidInput("key", f"must be a string, got {type(request.key).__name__}")
    if request.output not in (*IMAGE_OUTPUTS, *VIDEO_OUTPUTS):
        raise InvalidInput(
            "output",
            f"a sink stores encoded files: one of {[*IMAGE_OUTPUTS, *VIDEO_OUTPUTS]}, got {request.output!r}",
        )
    if request.stream:
        raise InvalidInput("stream", "a sink answers once every file is stored: send stream false with a sink")


def _check_latents(z: object) -> None:
    if not isinstance(z, torch.Tensor):
        raise InvalidInput("latents", f"must be a tensor, got {type(z).__name__}")
    if z.dtype not in LATENT_DTYPES:
        names = [str(d).removeprefix("torch.") for d in LATENT_DTYPES]
        raise InvalidInput("latents.dtype", f"unknown dtype {str(z.dtype).removeprefix('torch.')}; allowed: {names}")
    if not 1 <= z.dim() <= MAX_LATENT_DIMS or z.numel() == 0:
        raise InvalidInput("latents.shape", f"must have 1 to {MAX_LATENT_DIMS} non-empty dims, got {list(z.shape)}")


def _check_choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        close = get_close_matches(value, allowed, n=1, cutoff=0.6) if isinstance(value, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidInput(key, f"unknown value {value!r}{hint} (allowed: {list(allowed)})")


def _factor(key: str, value: object, nonzero: bool) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or (nonzero and value == 0):
        raise InvalidInput(key, f"must be a finite {'non-zero ' if nonzero else ''}number or nil, got {value!r}")
    return float(value)
