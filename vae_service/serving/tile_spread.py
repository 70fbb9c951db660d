"""One request across replicas: a tiled request's tiles go as sub-decodes to replicas of the
replica's own deployment, through its own handle (Serve's router picks the least loaded ones,
this replica included), and come back to be blended where the request is (engine.decode's
`spread`). An image tile comes back whole; a video tile as a stream of chunks, read by the engine
in lockstep with the other tiles'.

Each sub-decode carries its request's context: the engine's fingerprint (a replica that would
decode other bits refuses the tile, which is then decoded where the request is) and the time left
to its deadline (the receiver stops at it too). A sub-decode is never split again; a tile whose
replica fails is sent once more (the router tries another replica; a stream skips the chunks
already read), and a second failure fails the request with 503. Every wait checks the request in
slices: a caller that left stops it within one (DecodeAbandoned), the deadline answers 504.

The engine calls the spreader on its device thread and waits there, so a sub-decode does not
queue behind the device thread: it runs on the replica's one tile thread (`run_tile`,
`stream_tile`), a tile at a time."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from ray import serve
from ray.exceptions import RayError

from vae_service.engine.call import TileCall
from vae_service.engine.context import RequestContext
from vae_service.engine.errors import DecodeError, DecodeTimeout
from vae_service.protocol.errors import Unavailable

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class TileAnswer:
    """What a replica answers for a sub-decode (or one chunk of a video tile's)."""

    pixels: torch.Tensor | None
    replica: str
    refused: str | None = None  # why it did not decode it (another fingerprint, the deadline passed)


class ReplicaTiles:
    """The engine's TileSpreader inside a Serve replica."""

    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s
        self._handle = None

    def _deployment(self):
        if self._handle is None:  # on first use: the replica context exists only once the replica runs
            context = serve.get_replica_context()
            self._handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._handle

    def unavailable(self, error: BaseException) -> Unavailable:
        log.warning("a tile's sub-decode failed again: %s: %s", type(error).__name__, error)
        why = f"a tile of this request failed on two replicas ({type(error).__name__}); retry"
        return Unavailable("latents", why, self.retry_after_s)

    def _send(self, send: Callable):
        """A sub-decode sent; a failure to send (no controller, no replica) is the same 503 as a
        tile that failed twice."""
        try:
            return send()
        except Exception as error:
            raise self.unavailable(error) from None

    # ---- image tiles -------------------------------------------------------------------------
    def images(self, tiles: list[torch.Tensor], part: str, call: TileCall, local) -> Iterator[torch.Tensor]:
        """Every tile sent at once (paced), then each output in order as it arrives."""
        tiles = [_own(tile) for tile in tiles]
        context = call.context
        sent = []
        try:
            for tile in tiles:
                sent.append(self.paced(self._send(functools.partial(self._image, tile, part, call)), context))
            for tile, response in zip(tiles, list(sent), strict=True):
                yield self._image_output(tile, part, call, response, sent, local)
        finally:
            for response in sent:  # the other tiles' sub-decodes stop (a no-op for finished ones)
                response.cancel()

    def _image_output(self, tile, part: str, call: TileCall, response, sent: list, local) -> torch.Tensor:
        try:
            answer = _wait(response, call.context)
        except DecodeError:  # the request's own end (its deadline, its caller gone): never resent
            raise
        except Exception as first:
            _resending(first)
            sent.append(self._send(functools.partial(self._image, tile, part, call)))
            try:
                answer = _wait(sent[-1], call.context)
            except DecodeError:
                raise
            except Exception as second:
                raise self.unavailable(second) from None
        if answer.refused is not None:
            _refused(answer)
            return next(iter(local([tile])))
        call.replicas.add(answer.replica)
        return answer.pixels

    def _image(self, tile: torch.Tensor, part: str, call: TileCall):
        return self._deployment().decode_tile.remote(tile, part, call.fingerprint, call.context.remaining())

    # ---- video tiles -------------------------------------------------------------------------
    def chunks(
        self, tiles: list[torch.Tensor], quality: str, timestep: float | None, call: TileCall, local
    ) -> list[Iterator[torch.Tensor]]:
        siblings: list[TileStream] = []
        try:
            for tile in tiles:
                tile = _own(tile)
                send = _StreamSender(self, tile, quality, timestep, call)
                siblings.append(TileStream(send, call, siblings, self.unavailable, functools.partial(local, tile)))
        except BaseException:
            for stream in siblings:
                stream.close()
            raise
        return siblings

    @staticmethod
    def paced(response, context: RequestContext):
        """`response` once Serve's router gave it a replica: tiles sent all at once are routed on
        the same stale queue lengths (every tile of a Wan clip went to one replica); one after
        another, each sees the ones before it. Serve's DeveloperAPI, used as a wait only, in
        slices that check the request (every replica busy: the routing itself waits)."""
        wait = getattr(response, "_to_object_ref_gen_sync", None) or response._to_object_ref_sync

        def routed(slice_s: float) -> bool:
            try:
                wait(_timeout_s=slice_s)
            except TimeoutError:
                return False
            return True

        try:
            context.wait_until(routed, "routing a tile to another replica")
        except RayError:
            pass  # the read that follows fails alike, and is retried there
        except DecodeTimeout:
            raise  # past the deadline, or the caller left (DecodeAbandoned)
        except Exception as error:  # no object refs (Serve's gRPC transport): routed unpaced
            _warn_unpaced(error)
        return response


class _StreamSender:
    """Sends one video tile's sub-decode (again, after a failure)."""

    def __init__(self, spreader: ReplicaTiles, tile: torch.Tensor, quality: str, timestep, call: TileCall):
        self.spreader, self.tile, self.quality, self.timestep, self.call = spreader, tile, quality, timestep, call

    def __call__(self):
        spreader, call = self.spreader, self.call

        def send():
            handle = spreader._deployment().options(stream=True)
            return handle.decode_tile_chunks.remote(
                self.tile, self.quality, self.timestep, call.fingerprint, call.context.remaining()
            )

        return spreader.paced(spreader._send(send), call.context)


@functools.cache
def _warn_unpaced(error: Exception) -> None:
    log.warning("tiles are sent unpaced (%s: %s): they may crowd one replica", type(error).__name__, error)


def _own(tile: torch.Tensor) -> torch.Tensor:
    """`tile` on the host, copied only where it is a view: a view would carry its whole latent
    along to the other replica (the replay's recorded inputs are already tensors of their own)."""
    tile = tile.cpu()
    own = tile.is_contiguous() and tile.untyped_storage().nbytes() == tile.numel() * tile.element_size()
    return tile if own else tile.clone()


def _resending(error: Exception) -> None:
    log.warning("a tile's sub-decode failed (%s: %s); sending it once more", type(error).__name__, error)


def _refused(answer: TileAnswer) -> None:
    log.warning("replica %s refused a tile (%s); decoding it here", answer.replica, answer.refused)


def _wait(response, context: RequestContext) -> TileAnswer:
    """The sub-decode's answer, waited for in slices that check the request."""
    found: list[TileAnswer] = []

    def done(slice_s: float) -> bool:
        try:
            found.append(response.result(timeout_s=slice_s))
        except TimeoutError:
            return False
        return True

    context.wait_until(done, "a tile decoded by another replica")
    return found[0]


class TileStream:
    """One video tile's chunks from another replica, sent at once and read in order. A failed
    stream sends the tile once more and skips the chunks already read (a replica decodes a tile
    the same way as any other); a second failure cancels every sibling tile's stream. A refusal
    (another fingerprint) decodes the tile here instead. The request's end (its deadline, its
    caller leaving) cancels the stream at once; `close` (the engine, when it stops reading) too."""

    def __init__(self, send: Callable, call: TileCall, siblings: list, unavailable: Callable, local: Callable):
        self._send, self._call, self._siblings = send, call, siblings
        self._unavailable, self._local = unavailable, local
        self._read = 0  # chunks handed to the engine
        self._retried = False
        self._stream = self._timer = None
        self._here: Iterator[torch.Tensor] | None = None  # decoding locally after a refusal
        self._forget = call.context.on_end(self.close)
        self._open()

    def _open(self) -> None:
        self._stream, self._seen = self._send(), 0
        self._timer = threading.Timer(self._call.context.remaining(), self._cancel)
        self._timer.daemon = True
        self._timer.start()

    def _cancel(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def __iter__(self) -> TileStream:
        return self

    def __next__(self) -> torch.Tensor:
        if self._here is not None:
            return next(self._here)
        while self._stream is not None:
            try:
                answer = next(self._stream)
            except StopIteration:
                self._finish()
                raise
            except Exception as error:
                self._call.context.check("a tile streamed by another replica")
                self._again(error)
                continue
            if answer.refused is not None:
                _refused(answer)
                self._finish()
                self._here = iter(self._local())
                for _ in range(self._read):  # chunks already read (none: a refusal comes first)
                    next(self._here)
                return next(self._here)
            self._seen += 1
            if self._seen > self._read:
                self._call.replicas.add(answer.replica)
                self._read += 1
                return answer.pixels
        raise StopIteration

    def _again(self, error: Exception) -> None:
        self._finish()
        if self._retried:
            for sibling in self._siblings:
                sibling.close()
            raise self._unavailable(error) from None
        _resending(error)
        self._retried = True
        self._open()

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._stream = None

    def close(self) -> None:
        """Stop the remote decode (a failed sibling, a request abandoned or failed)."""
        self._cancel()
        self._finish()
        self._forget()


def sub_decode_context(fingerprint: str, remaining_s: float, own: str) -> RequestContext | str:
    """The receiving replica's context for a sub-decode, or why it refuses it."""
    if fingerprint != own:
        return f"this replica decodes as {own}, the request's replica as {fingerprint}"
    if remaining_s <= 0:
        return "the request's deadline passed before the tile arrived"
    return RequestContext(time.monotonic() + remaining_s, None, fingerprint)


def run_tile(executor: Executor, decode: Callable[[], torch.Tensor], context: RequestContext) -> asyncio.Future:
    """An image tile's decode on the replica's tile thread, its pixels on the host; not started
    once the request's deadline passed while the tile waited there (DecodeTimeout)."""

    def job() -> torch.Tensor:
        context.check("a tile waiting for another replica's tile thread")
        return decode().cpu()

    return asyncio.get_running_loop().run_in_executor(executor, job)


async def stream_tile(
    executor: Executor, chunks: Callable[[], Iterator[torch.Tensor]], context: RequestContext
) -> AsyncIterator[torch.Tensor]:
    """A video tile's chunks, decoded to the end in one job on the replica's tile thread (the
    tier's settings hold for the whole tile, and no other tile interleaves with it), each on the
    host as soon as it is decoded. Leaving early (the stream cancelled) or the request's deadline
    stops the decode at its next chunk."""
    loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

    def decode() -> None:
        try:
            for chunk in chunks():
                if stop.is_set() or context.ended:
                    return
                loop.call_soon_threadsafe(queue.put_nowait, ("chunk", chunk.cpu()))
        except Exception as error:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", error))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

    loop.run_in_executor(executor, decode)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value
    finally:
        stop.set()
