from vae_service.fastpath.install import FastPath, install_fast_path

__all__ = ["FastPath", "install_fast_path"]
