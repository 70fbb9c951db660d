"""The one service configuration, shared by the CLI, Serve `user_config`, YAML files and tests.

Invalid values fail at startup with pydantic's message, which names the field and the allowed values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Precision = Literal["auto", "fp32", "fp16", "bf16"]


class Limits(BaseModel):
    """Per-request budgets; over them a request gets 413 before any tensor work."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_bytes: int = Field(64 * 1024 * 1024, gt=0, description="msgpack body size")
    max_output_pixels: int = Field(
        2**25, gt=0, description="decoded pixels per request, summed over batch items and frames"
    )
    max_batch_items: int = Field(16, gt=0, description="latent batch dimension per request")


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "sd",
        description="preset name (sd, sdxl, flux, wan2.1, tiny-kl, tiny-wan), a local diffusers "
        "folder, or a hub id",
    )
    model_name: str | None = Field(None, description="name reported to clients; default: `model`")
    decode_precision: Precision = "auto"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    seed: int = Field(0, description="seed for preset random weights")
    cpu_threads: int | None = Field(None, gt=0, description="torch threads on CPU; default: all cores")
    limits: Limits = Limits()

    @property
    def served_name(self) -> str:
        return self.model_name or self.model
