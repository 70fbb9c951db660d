"""One request across replicas: a tiled `high` image's tiles go as sub-decodes to replicas of the
replica's own deployment, through its own handle (Serve's router picks the least loaded ones,
this replica included), and come back to be blended where the request is (engine.decode's
`spread`). A sub-decode is never split again; a tile whose replica fails is sent once more (the
router tries another replica), and a second failure fails the request with 503.

The engine calls the spreader on its device thread and waits there, so a sub-decode does not
queue behind the device thread: `decode_tile` runs on a thread of its own."""

from __future__ import annotations

import logging
import time

import torch
from ray import serve

from vae_service.protocol.errors import Unavailable

log = logging.getLogger("ray.serve")


class ReplicaTiles:
    """The engine's `spread` inside a Serve replica: (tiles, tier) -> (pixels in order, replicas)."""

    def __init__(self, retry_after_s: float, request_timeout_s: float):
        # every tile, sent once or twice, within the request's own deadline: a deployment saturated
        # with requests that wait for their tiles cannot hold one longer (503, retry later)
        self.retry_after_s, self.timeout_s = retry_after_s, request_timeout_s
        self._handle = None

    def _deployment(self):
        if self._handle is None:  # on first use: the replica context exists only once the replica runs
            context = serve.get_replica_context()
            self._handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._handle

    def __call__(self, tiles: list[torch.Tensor], quality: str) -> tuple[list[torch.Tensor], int]:
        deadline = time.monotonic() + self.timeout_s
        tiles = [tile.cpu().clone() for tile in tiles]  # a view would carry its whole latent along
        sent = [self._send(tile, quality) for tile in tiles]
        outputs, replicas = [], set()
        for tile, response in zip(tiles, sent, strict=True):
            try:
                pixels, replica = self._wait(response, deadline)
            except Exception as first:
                log.warning("a tile's sub-decode failed (%s: %s); sending it once more", type(first).__name__, first)
                try:
                    pixels, replica = self._wait(self._send(tile, quality), deadline)
                except Exception as second:
                    log.warning("a tile's sub-decode failed again: %s: %s", type(second).__name__, second)
                    for late in sent:
                        late.cancel()
                    why = f"a tile of this request failed on two replicas ({type(second).__name__}); retry"
                    raise Unavailable("latents", why, self.retry_after_s) from None
            outputs.append(pixels)
            replicas.add(replica)
        return outputs, len(replicas)

    def _send(self, tile: torch.Tensor, quality: str):
        return self._deployment().decode_tile.remote(tile, quality)

    @staticmethod
    def _wait(response, deadline: float):
        return response.result(timeout_s=max(0.0, deadline - time.monotonic()))
