"""One request across replicas: a tiled request's tiles go as sub-decodes to replicas of the
replica's own deployment, through its own handle (Serve's router picks the least loaded ones,
this replica included), and come back to be blended where the request is (engine.decode's
`spread`). An image tile comes back whole; a video tile as a stream of chunks, read by the engine
in lockstep with the other tiles'. A sub-decode is never split again; a tile whose replica fails
is sent once more (the router tries another replica; a stream skips the chunks already read),
and a second failure fails the request with 503. Every tile, sent once or twice, keeps to the
request's own deadline.

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

import torch
from ray import serve
from ray.exceptions import RayError

from vae_service.protocol.errors import Unavailable

log = logging.getLogger("ray.serve")


class ReplicaTiles:
    """The engine's TileSpreader inside a Serve replica."""

    def __init__(self, retry_after_s: float, request_timeout_s: float):
        # within the request's own deadline: a deployment saturated with requests that wait for
        # their tiles cannot hold one longer (503, retry later)
        self.retry_after_s, self.timeout_s = retry_after_s, request_timeout_s
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

    def images(self, tiles: list[torch.Tensor], part: str, replicas: set) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        tiles = [_own(tile) for tile in tiles]
        sent: list = []
        try:
            for tile in tiles:
                sent.append(self._paced(self._send(lambda tile=tile: self._image(tile, part)), deadline))
            outputs = []
            for tile, response in zip(tiles, list(sent), strict=True):
                try:
                    pixels, replica = _wait(response, deadline)
                except Exception as first:
                    if time.monotonic() >= deadline:
                        raise self.unavailable(first) from None
                    _resending(first)
                    sent.append(self._send(lambda tile=tile: self._image(tile, part)))
                    try:
                        pixels, replica = _wait(sent[-1], deadline)
                    except Exception as second:
                        raise self.unavailable(second) from None
                outputs.append(pixels)
                replicas.add(replica)
            return outputs
        except BaseException:
            for response in sent:  # the other tiles' sub-decodes stop (a no-op for finished ones)
                response.cancel()
            raise

    def _image(self, tile: torch.Tensor, part: str):
        return self._deployment().decode_tile.remote(tile, part)

    def chunks(
        self, tiles: list[torch.Tensor], quality: str, timestep: float | None, replicas: set
    ) -> list[Iterator[torch.Tensor]]:
        deadline = time.monotonic() + self.timeout_s
        siblings: list[TileStream] = []
        try:
            for tile in tiles:
                send = self._sender(_own(tile), quality, timestep, deadline)
                siblings.append(TileStream(send, replicas, deadline, siblings, self.unavailable))
        except BaseException:
            for stream in siblings:
                stream.close()
            raise
        return siblings

    def _sender(self, tile: torch.Tensor, quality: str, timestep: float | None, deadline: float):
        def stream():
            return self._deployment().options(stream=True).decode_tile_chunks.remote(tile, quality, timestep)

        return lambda: self._paced(self._send(stream), deadline)

    @staticmethod
    def _paced(response, deadline: float):
        """`response` once Serve's router gave it a replica: tiles sent all at once are routed on
        the same stale queue lengths (every tile of a Wan clip went to one replica); one after
        another, each sees the ones before it. Serve's DeveloperAPI, used as a wait only."""
        wait = getattr(response, "_to_object_ref_gen_sync", None) or response._to_object_ref_sync
        try:
            wait(_timeout_s=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, RayError):
            pass  # the read that follows fails alike, and is retried there
        except Exception as error:  # no object refs (Serve's gRPC transport): routed unpaced
            _warn_unpaced(error)
        return response


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


def _wait(response, deadline: float):
    return response.result(timeout_s=max(0.0, deadline - time.monotonic()))


class TileStream:
    """One video tile's chunks from another replica, sent at once and read in order. A failed
    stream sends the tile once more and skips the chunks already read (a replica decodes a tile
    the same way as any other); a second failure cancels every sibling tile's stream. The
    deadline cancels a stream that is still running then; `close` (the engine, when it stops
    reading) cancels it at once."""

    def __init__(self, send: Callable, replicas: set, deadline: float, siblings: list, unavailable: Callable):
        self._send, self._replicas, self._deadline = send, replicas, deadline
        self._siblings, self._unavailable = siblings, unavailable
        self._read = 0  # chunks handed to the engine
        self._retried = False
        self._stream = self._timer = None
        self._open()

    def _open(self) -> None:
        self._stream, self._seen = self._send(), 0
        self._timer = threading.Timer(max(0.0, self._deadline - time.monotonic()), self._stream.cancel)
        self._timer.daemon = True
        self._timer.start()

    def __iter__(self) -> TileStream:
        return self

    def __next__(self) -> torch.Tensor:
        while self._stream is not None:
            try:
                pixels, replica = next(self._stream)
            except StopIteration:
                self._finish()
                raise
            except Exception as error:
                self._again(error)
                continue
            self._seen += 1
            if self._seen > self._read:
                self._replicas.add(replica)
                self._read += 1
                return pixels
        raise StopIteration

    def _again(self, error: Exception) -> None:
        self._finish()
        if self._retried or time.monotonic() >= self._deadline:
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
        if self._stream is not None:
            self._stream.cancel()
        self._finish()


def run_tile(executor: Executor, decode: Callable[[], torch.Tensor]) -> asyncio.Future:
    """An image tile's decode on the replica's tile thread, its pixels on the host."""
    return asyncio.get_running_loop().run_in_executor(executor, lambda: decode().cpu())


async def stream_tile(executor: Executor, chunks: Callable[[], Iterator[torch.Tensor]]) -> AsyncIterator[torch.Tensor]:
    """A video tile's chunks, decoded to the end in one job on the replica's tile thread (the
    tier's settings hold for the whole tile, and no other tile interleaves with it), each on the
    host as soon as it is decoded. Leaving early (the stream cancelled) stops the decode at its
    next chunk."""
    loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

    def decode() -> None:
        try:
            for chunk in chunks():
                if stop.is_set():
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
