"""Ray-native composition without Serve: the decoder as a plain actor (Ray DAGs, compiled graphs)."""

from vae_service.ray.decoder_actor import Decoder, DecoderActor

__all__ = ["Decoder", "DecoderActor"]
