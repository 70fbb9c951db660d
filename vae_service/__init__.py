"""vae-service: a Ray Serve microservice dedicated to VAE decoding."""

__version__ = "0.1.0"
