"""Errors of model loading (at startup, never per request)."""


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded (bad path, unreachable hub, unsupported class)."""
