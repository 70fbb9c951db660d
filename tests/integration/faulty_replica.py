"""A decode replica with injected faults, for tests only (real Serve, real engines; the faults are
the only stand-in): what it does is read from a JSON file the test writes, so one deployment serves
several cases.

- `{"tiles": "hang"}`: it takes every tile offered, then never sends it (a replica that hangs), and
  leaves a file `.taken` beside the faults file (and `.batch-done` whenever a batch of its own ended);
- `{"out_of_memory": [h, w]}`: its decoder runs out of device memory once on latents of h x w
  (a request's whole decode; its tiles are smaller);
- `skew_first` (a deployment argument): the first of its replicas to start decodes in bf16 (a
  rolling update, another node: a replica that would decode other bits).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import torch
from ray import serve

from vae_service.config import ServiceConfig
from vae_service.engine.execution.peer_contract import Accepted
from vae_service.serving.replica import DecoderReplica, replica_id


class FaultyReplica(DecoderReplica):
    def __init__(self, config: dict, serve_options: dict | None, faults: str, skew_first: bool = False):
        self.faults = Path(faults)
        config = ServiceConfig.model_validate(config)
        if skew_first and self._first_to_start():
            config = config.model_copy(update={"decode_precision": "bf16"})
        super().__init__(config, serve_options)
        self.ran_out = False
        self.service.engine.vae.decoder.register_forward_pre_hook(self._out_of_memory)

    def _first_to_start(self) -> bool:
        try:
            os.close(os.open(self.faults.with_suffix(".skewed"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def _fault(self) -> dict:
        try:
            return json.loads(self.faults.read_text())
        except (OSError, ValueError):
            return {}

    def _out_of_memory(self, module, args) -> None:
        shape = self._fault().get("out_of_memory")
        if shape is not None and not self.ran_out and list(args[0].shape[-2:]) == shape:
            self.ran_out = True
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    def _observe_batch(self, stats) -> None:
        super()._observe_batch(stats)
        self.faults.with_suffix(".batch-done").touch()  # the device thread is free again

    async def decode_tile_job(self, job, fingerprint: str, remaining_s: float):
        if self._fault().get("tiles") == "hang":
            yield Accepted(replica_id())
            self.faults.with_suffix(".taken").touch()
            await asyncio.Event().wait()
        async for message in super().decode_tile_job(job, fingerprint, remaining_s):
            yield message


def faulty_app(config: dict, faults: Path, skew_first: bool = False, **deployment_options):
    """A deployment of FaultyReplica with `config`, its live part as user_config (as serving/app.py)."""
    parsed = ServiceConfig.model_validate(config)
    options = {**parsed.deployment_options(), **deployment_options}
    deployment = serve.deployment(name="VaeDecoder")(FaultyReplica)
    return deployment.options(user_config=parsed.live().model_dump(), **options).bind(
        parsed.model_dump(), {}, str(faults), skew_first
    )
