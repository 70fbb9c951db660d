from vae_service.engine.engine import DecodeEngine
from vae_service.engine.request.decode_request import OUTPUTS, QUALITIES, DecodeRequest
from vae_service.engine.request.errors import (
    DecodeError,
    DecodeFailed,
    DecodeTimeout,
    InvalidInput,
    LimitExceeded,
    OutOfMemory,
    Overloaded,
)
from vae_service.engine.request.latents import BatchKey, PreparedRequest
from vae_service.engine.request.result import DecodeResult, Timing

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
