from vae_service.engine.engine import DecodeEngine
from vae_service.engine.errors import (
    DecodeError,
    DecodeFailed,
    DecodeTimeout,
    InvalidInput,
    LimitExceeded,
    OutOfMemory,
    Overloaded,
)
from vae_service.engine.latents import BatchKey, PreparedRequest
from vae_service.engine.request import OUTPUTS, QUALITIES, DecodeRequest
from vae_service.engine.result import DecodeResult, Timing

__all__ = [
    "OUTPUTS",
    "QUALITIES",
    "BatchKey",
    "DecodeEngine",
    "DecodeError",
    "DecodeFailed",
    "DecodeRequest",
    "DecodeResult",
    "DecodeTimeout",
    "InvalidInput",
    "LimitExceeded",
    "OutOfMemory",
    "Overloaded",
    "PreparedRequest",
    "Timing",
]
