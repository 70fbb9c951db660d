from vae_service.engine.engine import DecodeEngine, DecodeResult
from vae_service.engine.latents import PreparedRequest

__all__ = ["DecodeEngine", "DecodeResult", "PreparedRequest"]
