"""A deployment's named object-storage sinks (ServiceConfig.sinks): a request that names one
(`sink`, `key`) has each item's encoded file written there, whole or not at all
(vae_service/storage/), and answers `output` as [{uri, size, sha256}], one map per item.

The sink's name and the key are checked when the request is parsed, before any decode (400 naming
`sink` or `key`). Files are written after encoding, each sink behind its own bulkhead
(sink_writes.py: its threads, at most `max_concurrent_writes` at once, a full sink refusing at once
with 503 + Retry-After; never the device thread), within the sink's `write_timeout_s` (503 past it)
and the request's deadline (504 past it): a write not yet moved to its name stops, leaving nothing
there. A store that fails answers 503 `unavailable` naming the sink, with Retry-After, or 424
`store_refused` where it refused for good (or the sink's location cannot be opened: its endpoint
from the environment is not one); the cause goes to the log under an error id (its text through
storage's `scrub`), never to the caller. A folder standing where a file goes (a local sink)
answers 400 naming `key` and the taken name: the caller's name, not the store, is at fault. Each file is whole
under its name or absent; on a failure, files of the same request already written stay (each
whole) and the retry overwrites them. gRPC has no `sink` field: HTTP and handles only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace

from vae_service.config import Sink
from vae_service.engine import DecodeRequest, DecodeResult
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeTimeout, InvalidInput, StoreRefused, Unavailable
from vae_service.serving.outputs.sink_writes import SinkWrites
from vae_service.storage import (
    InvalidKey,
    Location,
    LocationError,
    RefusedByStore,
    StoredObject,
    StoreUnavailable,
    object_names,
    open_location,
    parse_uri,
    scrub,
)

log = logging.getLogger("ray.serve")


class Sinks:
    """`on_change`: called after each request's writes (the replica reports the sinks' metrics)."""

    def __init__(self, sinks: Mapping[str, Sink], retry_after_s: float, on_change: Callable[[], None] | None = None):
        self.config, self.retry_after_s, self.on_change = dict(sinks), retry_after_s, on_change
        self._locations: dict[str, Location] = {}
        # the object key each sink's files go under (its length counts toward an object name's bound)
        self._prefixes = {name: parse_uri(sink.uri).object_key for name, sink in self.config.items()}
        self._lock = threading.Lock()
        self.writes = {name: SinkWrites(name, sink.max_concurrent_writes) for name, sink in self.config.items()}

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
                options = sink.model_dump(exclude={"uri", "max_concurrent_writes", "write_timeout_s"})
                self._locations[name] = open_location(sink.uri, **options)
            return self._locations[name]

    def describe(self) -> dict:
        """/health's `sink_writes`: each sink's capacity, writes in flight, stuck calls and counts."""
        return {name: writes.describe() for name, writes in sorted(self.writes.items())}

    async def store(self, result: DecodeResult, request: DecodeRequest, context: RequestContext) -> DecodeResult:
        """Write the result's files (encoded, one per item) to the request's sink; the result with
        `output` as their [{uri, size, sha256}]."""
        try:
            return await self._store(result, request, context)
        finally:
            if self.on_change is not None:
                self.on_change()

    async def _store(self, result: DecodeResult, request: DecodeRequest, context: RequestContext) -> DecodeResult:
        files: list[bytes] = result.output
        names, sink = self._names(request, len(files)), request.sink
        writes = self.writes[sink]
        if not writes.admit(len(files)):
            raise Unavailable(
                "sink",
                f"sink {sink!r} is busy: its {writes.capacity} writes at once (max_concurrent_writes) are taken, or as "
                "many calls to its store have not answered; retry later",
                self.retry_after_s,
            )
        started = [
            writes.start(lambda n=n, d=d: self._write(sink, n, d, context)) for n, d in zip(names, files, strict=True)
        ]
        timeout = self.config[sink].write_timeout_s
        try:
            stored: list[StoredObject] = await asyncio.wait_for(
                asyncio.gather(*(future for future, _ in started)), min(timeout, context.remaining())
            )
        except (TimeoutError, DecodeTimeout):  # the wait's, or a write's own check of the deadline
            context.abandon()  # writes not yet moved to their names stop at their next check
            writes.abandon([state for _, state in started])
            if context.remaining() > 0:
                raise self._unanswered(sink, timeout) from None
            raise DecodeTimeout("sink", f"not written to sink {sink!r} within request_timeout_s") from None
        except StoreUnavailable as exc:
            raise self._failed(sink, exc) from None
        except asyncio.CancelledError:
            context.abandon()  # the caller left: writes not yet moved to their names stop
            writes.abandon([state for _, state in started])
            raise
        return replace(result, output=[s.to_map() for s in stored])

    def _unanswered(self, sink: str, timeout: float) -> Unavailable:
        return Unavailable(
            "sink",
            f"sink {sink!r} did not answer within write_timeout_s ({timeout:g} s); nothing was stored under the names "
            "of the files that were not written; retry later",
            self.retry_after_s,
        )

    def _write(self, sink: str, name: str, data: bytes, context: RequestContext) -> StoredObject:
        try:
            location = self.location(sink)
        except LocationError as exc:  # the environment's endpoint is not one: a retry would meet it again
            raise RefusedByStore(f"sink {sink!r}: {exc}") from exc
        except (ValueError, OSError) as exc:  # a filesystem that cannot even be made (GCS credentials, ...)
            raise StoreUnavailable(f"sink {sink!r}: {scrub(exc)}") from exc
        try:
            return location.child(name).write_whole(data, check=lambda: context.check(f"writing to sink {sink!r}"))
        except InvalidKey as exc:  # a folder of the key is a link, or a folder stands at the file's name
            raise InvalidInput("key", str(exc)) from None

    def _failed(self, sink: str, exc: OSError) -> Unavailable | StoreRefused:
        """The caller's error: 424 where the store refused for good (not retried), else 503 with
        Retry-After; the store's own words go to the log, under the error id the message carries."""
        error_id = uuid.uuid4().hex[:12]
        log.error("writing to sink %s failed, error id %s: %s", sink, error_id, scrub(exc))
        if isinstance(exc, RefusedByStore):
            return StoreRefused(
                "sink",
                f"sink {sink!r} refused the write (error id {error_id}, see the server log): a bucket that does not "
                "exist, access denied, a refused credential or an endpoint that is not one; a retry would be refused "
                "again: the deployment's sink or its credentials need fixing",
            )
        return Unavailable(
            "sink",
            f"sink {sink!r} could not be written (error id {error_id}, see the server log); nothing was stored "
            "under the names of the files that failed; retry later",
            self.retry_after_s,
        )

    def shutdown(self) -> None:
        """Nothing to stop: each write's thread ends with its call (a stuck one is a daemon)."""
