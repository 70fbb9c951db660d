from vae_service.models.errors import ModelLoadError
from vae_service.models.loading import LoadedVae, load_vae
from vae_service.models.presets import PRESETS
from vae_service.models.spec import ModelSpec

__all__ = ["PRESETS", "LoadedVae", "ModelLoadError", "ModelSpec", "load_vae"]
