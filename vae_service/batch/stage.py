"""The decode stage of a Ray Data job: a callable class that Ray Data runs in an actor pool, each
actor holding one engine (its model loaded once, on its GPU when it has one). Every input is
decoded as the service decodes one request (its own engine call, the same tiers, outputs and
encoder settings), so its files are the bytes the service would answer. A bad input becomes a
`failed` row with its reason; it never stops the job. A store that fails for several inputs in a
row (stopped, unreachable, refusing) does: the engine's later inputs are `stopped` rows, at once,
with no call to the store (a rerun resumes where the store failed)."""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import numpy as np

from vae_service.batch.latent_files import load_latents
from vae_service.batch.outputs import OutputFolder
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine, DecodeError, DecodeRequest
from vae_service.protocol.requests import request_from_call
from vae_service.storage import StoreUnavailable, scrub

log = logging.getLogger(__name__)

RESULT_COLUMNS = ("name", "status", "files", "items", "error", "decode_ms")
# the scheduler's class a batch job's items carry unless the job names another (names.PRIORITIES):
# offline work yields to live requests and sessions
BATCH_PRIORITY = "bulk"
# store failures in a row after which an engine stops: a store that is down fails every input, and
# each would wait for its connect and request timeouts
STOP_AFTER_STORE_FAILURES = 3


@dataclass(frozen=True)
class ItemResult:
    name: str
    status: str  # decoded | skipped (its files were there) | failed | stopped (not tried: the store failed)
    files: int = 0
    items: int = 0  # latent items (batch dimension) of the input
    error: str = ""
    decode_ms: float = 0.0


class DecodeStage:
    def __init__(
        self,
        config: dict,
        output_dir: str,
        output: str | None,
        quality: str = "lossless",
        options=None,
        stop_after_store_failures: int = STOP_AFTER_STORE_FAILURES,
        priority: str = BATCH_PRIORITY,
    ):
        """`output_dir`: a local folder or a store's URI (s3://bucket/prefix?endpoint_override=...);
        `priority`: the scheduler's class every item's request carries."""
        self.engine = DecodeEngine(ServiceConfig.model_validate(config))
        self.engine.bind_thread()
        # unset: what a service client asks for by default, PNGs of images and MP4s of videos
        self.folder = OutputFolder(output_dir, output or ("mp4" if self.engine.video else "png"))
        self.folder.folder.make_dirs()  # a local folder; a store needs none
        self.quality, self.options, self.priority = quality, dict(options or {}), priority
        self.stop_after_store_failures = stop_after_store_failures
        self.store_failures = 0  # in a row
        self.stopped_by = ""  # the store failure that stopped this engine
        log.info("decode stage in pid %d: %s", os.getpid(), self.engine.spec.name)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = [self.decode_row(batch, i) for i in range(len(batch["name"]))]
        return {key: np.array([getattr(r, key) for r in results]) for key in RESULT_COLUMNS}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> ItemResult:
        name = str(batch["name"][i])
        if self.stopped_by:
            return ItemResult(name, "stopped", error=self.stopped_by)
        try:
            result = self.decode_item(name, _row_latents(batch, i))
            self.store_failures = 0
            return result
        except StoreUnavailable as exc:  # its input's or output's store failed: a rerun does it
            self.store_failures += 1
            if self.store_failures >= self.stop_after_store_failures:
                self.stopped_by = f"the store failed for {self.store_failures} inputs in a row, the last: {scrub(exc)}"
                log.warning("decode stage stops: %s", self.stopped_by)
            return ItemResult(name, "failed", error=f"store: {scrub(exc)}")
        except (DecodeError, ValueError) as exc:  # bad input (an output's name a folder holds): the item's own
            return ItemResult(name, "failed", error=scrub(exc))
        except Exception as exc:  # a fault of ours: reported, logged (its text scrubbed), and the job goes on
            log.error("decoding %s failed: %s", name, scrub("".join(traceback.format_exception(exc))))
            return ItemResult(name, "failed", error=scrub(f"internal error ({type(exc).__name__}): {exc}"))

    def request(self, latents) -> DecodeRequest:
        """An input's latents as the request the engine decodes: the job's options, quality, output
        and priority."""
        return request_from_call(
            latents,
            **{
                **self.options,
                "quality": self.quality,
                "output": "uint8" if self.folder.output == "npy" else self.folder.output,
                "priority": self.priority,
            },
        )

    def decode_item(self, name: str, latents) -> ItemResult:
        request = self.request(latents)
        paths = self.folder.paths(name, request.items)
        if self.folder.finished(paths):
            return ItemResult(name, "skipped", files=len(paths), items=request.items)
        (result,) = self.engine.decode([self.engine.prepare(request)])
        if isinstance(result, DecodeError):
            raise result
        result = self.engine.encode(result)
        self.folder.write(paths, result.output if self.folder.output != "npy" else result.output.numpy())
        return ItemResult(
            name, "decoded", files=len(paths), items=request.items, decode_ms=round(result.timing.decode_ms, 1)
        )


def _row_latents(batch: dict[str, np.ndarray], i: int):
    """A row holds a file's path (the file's latents, as `vae-service decode` sends them) or one
    latent item itself (Parquet: without the batch dimension)."""
    if "path" in batch:
        return load_latents(str(batch["path"][i]))  # a local path or a store's URI
    value = batch["latents"][i]
    if value.dtype == object:  # a Parquet list column: arrays of arrays, numbers without a dtype
        value = _stacked(value).astype(np.float32)
    return np.ascontiguousarray(value)[None]


def _stacked(value: np.ndarray) -> np.ndarray:
    if value.dtype != object:
        return value
    try:
        return np.stack([_stacked(np.asarray(v)) for v in value])
    except ValueError:
        raise ValueError("latents: a list column's rows must be rectangular (equal lengths at each depth)") from None
