"""A deployment's named object-storage sinks (ServiceConfig.sinks): a request that names one
(`sink`, `key`) has each item's encoded file written there, whole or not at all
(vae_service/storage/), and answers `output` as [{uri, size, sha256}], one map per item.

The sink's name and the key are checked when the request is parsed, before any decode (400 naming
`sink` or `key`). Files are written after encoding, on this module's own small pool (never the
device thread), within the request's deadline (504 past it: a write not yet moved to its name
stops, leaving nothing there). A store that fails answers 503 `unavailable` naming the sink, with
Retry-After; the cause goes to the log under an error id, never to the caller. Each file is whole
under its name or absent; on a failure, files of the same request already written stay (each
whole) and the retry overwrites them. gRPC has no `sink` field: HTTP and handles only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from vae_service.config import Sink
from vae_service.engine import DecodeRequest, DecodeResult
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeTimeout, InvalidInput, Unavailable
from vae_service.storage import (
    InvalidKey,
    Location,
    StoredObject,
    StoreUnavailable,
    object_names,
    open_location,
    parse_uri,
)

log = logging.getLogger("ray.serve")

SINK_THREADS = 4  # files written at once by a replica (I/O bound: a request's items in parallel)


class Sinks:
    def __init__(self, sinks: Mapping[str, Sink], retry_after_s: float):
        self.config, self.retry_after_s = dict(sinks), retry_after_s
        self._locations: dict[str, Location] = {}
        # the object key each sink's files go under (its length counts toward an object name's bound)
        self._prefixes = {name: parse_uri(sink.uri).object_key for name, sink in self.config.items()}
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(SINK_THREADS, thread_name_prefix="vae-sink") if sinks else None

    @property
    def names(self) -> list[str]:
        """What /health lists (names only: a sink's URI and endpoint stay in the config)."""
        return sorted(self.config)

    def check(self, request: DecodeRequest) -> DecodeRequest:
        """A request's sink and key, before anything is decoded; raises InvalidInput naming one."""
        if request.sink is None:
            return request
        if request.sink not in self.config:
            configured = f"this deployment's sinks: {self.names}" if self.config else "this deployment has no sinks"
            raise InvalidInput("sink", f"unknown sink {request.sink!r} ({configured})")
        self._names(request, request.items)
        return request

    def _names(self, request: DecodeRequest, items: int) -> list[str]:
        try:
            return object_names(request.key, request.output, items, self._prefixes[request.sink])
        except InvalidKey as exc:
            raise InvalidInput("key", str(exc)) from None

    def location(self, name: str) -> Location:
        """The sink's root, opened on first use (no connection is made until a file is written)."""
        with self._lock:
            if name not in self._locations:
                sink = self.config[name]
                options = sink.model_dump(exclude={"uri"})
                self._locations[name] = open_location(sink.uri, **options)
            return self._locations[name]

    async def store(self, result: DecodeResult, request: DecodeRequest, context: RequestContext) -> DecodeResult:
        """Write the result's files (encoded, one per item) to the request's sink; the result with
        `output` as their [{uri, size, sha256}]."""
        files: list[bytes] = result.output
        names = self._names(request, len(files))
        loop = asyncio.get_running_loop()
        work = [
            loop.run_in_executor(self.executor, self._write, request.sink, name, data, context)
            for name, data in zip(names, files, strict=True)
        ]
        try:
            stored: list[StoredObject] = await asyncio.wait_for(asyncio.gather(*work), context.remaining())
        except (TimeoutError, DecodeTimeout):  # the wait's, or a write's own check of the deadline
            raise DecodeTimeout("sink", f"not written to sink {request.sink!r} within request_timeout_s") from None
        except StoreUnavailable as exc:
            raise self._unavailable(request.sink, exc) from None
        except asyncio.CancelledError:
            context.abandon()  # the caller left: writes not yet moved to their names stop
            raise
        return replace(result, output=[s.to_map() for s in stored])

    def _write(self, sink: str, name: str, data: bytes, context: RequestContext) -> StoredObject:
        try:
            location = self.location(sink)
        except (ValueError, OSError) as exc:  # a filesystem that cannot even be made (GCS credentials, ...)
            raise StoreUnavailable(f"sink {sink!r}: {exc}") from exc
        try:
            return location.child(name).write_whole(data, check=lambda: context.check(f"writing to sink {sink!r}"))
        except InvalidKey as exc:  # a folder of the key is a link in the sink's folder: never followed
            raise InvalidInput("key", str(exc)) from None

    def _unavailable(self, sink: str, exc: BaseException) -> Unavailable:
        error_id = uuid.uuid4().hex[:12]
        log.error("writing to sink %s failed, error id %s: %s", sink, error_id, exc)
        return Unavailable(
            "sink",
            f"sink {sink!r} could not be written (error id {error_id}, see the server log); nothing was stored "
            "under the names of the files that failed; retry later",
            self.retry_after_s,
        )

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)
