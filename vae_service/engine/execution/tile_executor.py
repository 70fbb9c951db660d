"""One tile mechanism: a request's tile jobs (engine/runtime/tile_jobs.py) decoded by an executor that yields
their outputs in the order the blend reads them, for images and video alike. Two executors:

- `LocalTiles`: on this device, lazily: a job runs when the blend first reads it, so images and
  video tile after tile hold one tile's working set at a time (video in lockstep holds every
  tile's causal history);
- `SharedTiles`: the deployment's replicas (a `TilePeers`: serving/scheduling/tile_peers.py's; the engine never
  imports Ray) and this device together. A tile goes to a replica only through its free slot: a
  replica takes a tile only while its device is idle, one at a time, planned for its own bound
  (serving/scheduling/tile_peers.py), and otherwise refuses it at once; this device decodes every tile no
  replica took, and meanwhile the tiles ahead of the blend, so a saturated deployment decodes as
  if nothing were shared. Every replica with the request's fingerprint decodes a job to the same
  bits, so the answer is the one `LocalTiles` gives.

Order: one output per job in job order (images, the class's own tiled decode); video tiles of a
tier one chunk per latent frame, in lockstep (chunk k of every tile before chunk k+1 of any) or,
here only, tile after tile. Remote means lockstep: a tile's history stays where it is decoded, and
this device holds only the blend.

Bounds: at most a window of jobs (`TILE_WINDOW`, or fewer where the plan's bound leaves less room)
between the blend and the furthest tile decoding; what is held meanwhile (at most `window - 1`
finished outputs) is counted in the plan (engine/planning/tiling.py's tile_for). Failures: a refusal (no
free slot, another fingerprint, no time left, over its bound) decodes the tile here; a lost tile
(the replica went away, was overloaded, or its stream ended short) is decoded once more, by a
replica that takes it or here, and a second loss answers 503 (`Unavailable`); anything else a
replica raised is a bug, 500 (`TileBug`). None of these fails the batch: the request alone gets
the error (the scheduler never re-runs it). Every wait checks the request in slices
(engine/request/context.py): a caller that leaves, or the deadline, stops it within one, and every tile
still out is cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Protocol

import torch

from vae_service.engine.execution.call import checked_chunks, step_running_call
from vae_service.engine.execution.peer_contract import (
    Accepted,
    Chunk,
    End,
    NotShared,
    RemoteTile,
    TileBug,
    TileCall,
    TileLost,
    TilePeers,
    TileRefused,
)
from vae_service.engine.request.context import WAIT_SLICE_S
from vae_service.engine.request.errors import Unavailable
from vae_service.engine.runtime.runtime import Runtime
from vae_service.engine.runtime.tile_jobs import TILE_WINDOW, TileJob, TileOutput, gives_chunks

log = logging.getLogger(__name__)

OFFER_WAIT_S = 0.5  # an offer no replica has taken by then (Serve still routing it) is decoded here
STREAM_REFUSALS = 2  # video tiles are offered at the start until this many were refused
DISPATCH_POLL_S = 0.005  # how often the dispatcher looks for replicas' answers while none comes


class TileExecutor(Protocol):
    def run(
        self, jobs: list[TileJob], lockstep: bool = True, optional: bool = False, window: int = TILE_WINDOW
    ) -> Iterator[TileOutput]:
        """Every job's output in blend order. `optional`: the tiles are worth it only if other replicas
        decode some (a request that fits whole); raises NotShared before any work when none will.
        `window`: single-output jobs from the blend's to the furthest decoding (what the plan counted
        as held: `window - 1` finished outputs)."""


# ---- here -------------------------------------------------------------------------------------
class LocalTiles:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def lazy(self, job: TileJob) -> Iterator[torch.Tensor]:
        """The job's chunks, started when first read; each chunk of a tile is a step (nothing of a
        tile lives on the model between its chunks: the walk's state is the job's own)."""
        with closing(self.runtime.run_job(job)) as chunks:
            yield from checked_chunks(chunks, step_running_call)

    def run(
        self, jobs: list[TileJob], lockstep: bool = True, optional: bool = False, window: int = TILE_WINDOW
    ) -> Iterator[TileOutput]:
        if optional:
            raise NotShared
        runs = [self.lazy(job) for job in jobs]
        try:
            if not lockstep:
                for j, run in enumerate(runs):
                    for pixels in run:
                        yield TileOutput(j, pixels)
                return
            yield from _in_lockstep(len(runs), lambda j: next(runs[j], None))
        finally:
            for run in runs:
                run.close()


def _in_lockstep(n: int, next_chunk) -> Iterator[TileOutput]:
    """Chunk k of every tile before chunk k+1 of any; `next_chunk(j)`: tile j's next, None at its end."""
    while True:
        for j in range(n):
            pixels = next_chunk(j)
            if pixels is None:
                if j or any(next_chunk(k) is not None for k in range(1, n)):
                    raise RuntimeError("the tiles of one grid gave different numbers of chunks")
                return
            yield TileOutput(j, pixels)


# ---- the deployment's replicas and here --------------------------------------------------------
class _Out:
    """One job given to a replica: its messages as they arrive."""

    def __init__(self, job: int, remote: RemoteTile):
        self.job, self.remote = job, remote
        self.offered = time.monotonic()
        self.replica: str | None = None  # once accepted
        self.chunks: list[torch.Tensor] = []  # arrived, not read yet
        self.ended: End | None = None
        self.seen = 0  # chunks taken from it
        self.skip = 0  # chunks to drop first (a resent stream: the blend already has them)

    def close(self) -> None:
        self.remote.cancel()


class SharedTiles:
    def __init__(self, local: LocalTiles, peers: TilePeers, call: TileCall):
        self.local, self.peers, self.call = local, peers, call
        self.device = local.runtime.device
        self.losses: dict[int, int] = {}

    def run(
        self, jobs: list[TileJob], lockstep: bool = True, optional: bool = False, window: int = TILE_WINDOW
    ) -> Iterator[TileOutput]:
        self.losses = {}  # per run: the class's tiled decode runs the executor once per pass
        if jobs and gives_chunks(jobs[0], self.local.runtime.chunked):
            if not lockstep:
                raise ValueError("tiles on other replicas run in lockstep: their histories stay there")
            return self._streams(jobs, optional)
        return _Outputs(self, jobs, window).run(optional)

    # ---- talking to replicas --------------------------------------------------------------
    def offer(self, job: TileJob, j: int) -> _Out:
        return _Out(j, self.peers.offer(job, self.call))

    def pump(self, out: _Out, timeout_s: float) -> bool:
        """Read one message of `out` if one comes within `timeout_s`; False when none did. Raises
        TileRefused (an offer not taken within OFFER_WAIT_S is refused here), TileLost, TileBug."""
        try:
            message = out.remote.poll(timeout_s)
        except (TileRefused, TileLost):
            raise
        except Exception as error:
            log.error("a replica failed tile %d of this request: %s: %s", out.job, type(error).__name__, error)
            raise TileBug(f"a replica failed a tile of this request ({type(error).__name__})") from None
        if message is None:
            if out.replica is None and time.monotonic() - out.offered > OFFER_WAIT_S:
                out.remote.cancel()
                raise TileRefused("no replica took it in time")
            return False
        if isinstance(message, Accepted):
            out.replica = message.replica
        elif isinstance(message, Chunk):
            out.chunks.append(message.pixels)
        else:
            out.ended = message
        return True

    def answered(self, out: _Out, j: int) -> bool:
        """Wait (in slices that check the request) until `out` (tile j) is accepted; False if refused,
        or lost before its answer (a loss like any other: decoded here, and a second one answers 503)."""
        try:
            self.call.context.wait_until(lambda s: self.pump(out, s) and out.replica is not None, "a tile's offer")
        except TileRefused:
            return False
        except TileLost as error:
            out.close()
            self.lost(j, error)
            return False
        except BaseException:  # the request ended, or a bug: not yet in any book that cancels at the end
            out.close()
            raise
        return True

    def lost(self, j: int, error: TileLost) -> None:
        """Tile j is decoded once more; its second loss answers 503."""
        self.losses[j] = self.losses.get(j, 0) + 1
        if self.losses[j] > 1:
            log.warning("tile %d of this request was lost twice: %s", j, error)
            why = f"a tile of this request was lost on two replicas ({error}); retry"
            raise Unavailable("latents", why, self.peers.retry_after_s)
        log.warning("tile %d of this request was lost (%s); decoding it once more", j, error)

    def used(self, out: _Out, pixels: torch.Tensor) -> torch.Tensor:
        self.call.replicas.add(out.replica)
        return pixels.to(self.device)

    # ---- video tiles: chunk streams in lockstep -------------------------------------------
    def _streams(self, jobs: list[TileJob], optional: bool) -> Iterator[TileOutput]:
        n = len(jobs)
        sources: list[_Out | _LocalRun | None] = [None] * n
        try:
            refused = 0
            for j in reversed(range(n)):  # each offer answered before the next: routed one by one
                out = self.offer(jobs[j], j)
                if self.answered(out, j):
                    sources[j] = out
                elif (refused := refused + 1) == STREAM_REFUSALS:
                    break
            if optional and all(source is None for source in sources):
                raise NotShared
            for j in range(n):
                if sources[j] is None:
                    sources[j] = _LocalRun(self.local.lazy(jobs[j]))
            yield from _in_lockstep(n, lambda j: self._next_chunk(jobs, sources, j))
        finally:
            for source in sources:
                if source is not None:
                    source.close()

    def _next_chunk(self, jobs: list[TileJob], sources: list, j: int) -> torch.Tensor | None:
        """Tile j's next chunk (None: it ended); a lost stream is replaced once (another replica that
        takes it, else here), the chunks the blend already has skipped."""
        while True:
            source = sources[j]
            if isinstance(source, _LocalRun):
                return source.next()
            try:
                pixels = self._remote_chunk(source)
            except TileLost as error:
                source.close()
                self.lost(j, error)
                again = self.offer(jobs[j], j)
                sources[j] = again if self.answered(again, j) else _LocalRun(self.local.lazy(jobs[j]))
                sources[j].skip = source.seen
                continue
            return None if pixels is None else self.used(source, pixels)

    def _remote_chunk(self, out: _Out) -> torch.Tensor | None:
        def arrived(slice_s: float) -> bool:
            self.pump(out, slice_s)
            return bool(out.chunks) or out.ended is not None

        while True:
            self.call.context.wait_until(arrived, "a tile streamed by another replica")
            if out.chunks:
                pixels = out.chunks.pop(0)
                out.seen += 1
                if out.seen > out.skip:
                    return pixels
                continue
            if out.ended.chunks != out.seen:
                raise TileLost(f"its stream ended after {out.seen} of {out.ended.chunks} chunks")
            return None


class _Outputs:
    """One run of single-output jobs shared with replicas. This device takes jobs from the blend's
    end of a window of jobs and waits for the outputs the blend needs next; a dispatcher
    thread gives jobs from the window's far end to replicas, one offer open at a time (each routed
    before the next), and takes their outputs as they come, so a replica that finished a tile is
    offered the next at once, not when this device next looks. A refusal pauses the offers for as
    many tiles decoded here as 2 ** (refusals in a row - 1): a busy deployment is asked less and
    less; a tile that comes back (a slot freed) ends the pause."""

    def __init__(self, shared: SharedTiles, jobs: list[TileJob], window: int):
        self.shared, self.jobs, self.window = shared, jobs, window
        self.unstarted = list(range(len(jobs)))
        self.out: dict[int, _Out] = {}  # given to replicas, not back yet
        self.held: dict[int, torch.Tensor] = {}  # outputs the blend has not reached
        self.open: _Out | None = None  # the offer not answered yet
        self.resend: list[int] = []  # lost: offered once more before this device takes them
        self.refusals = 0  # in a row
        self.decoded_here = 0
        self.resume_at = 0  # decoded_here at which offers resume after a refusal
        self.nxt = 0  # the job the blend needs next
        self.failed: BaseException | None = None  # the dispatcher's, raised on the device thread
        self.ended = False
        self.changed = threading.Condition()  # guards all of the above

    def run(self, optional: bool) -> Iterator[TileOutput]:
        shared, n = self.shared, len(self.jobs)
        dispatcher = None
        try:
            if optional:  # the window's far end, answered before any work here
                far = min(n, self.window) - 1
                first = shared.offer(self.jobs[far], far)
                if not shared.answered(first, far):
                    raise NotShared
                self.unstarted.remove(far)
                self.out[far] = first
            dispatcher = threading.Thread(target=self._dispatch, daemon=True, name="vae-tile-dispatch")
            dispatcher.start()
            while self.nxt < n:
                j, pixels = self._next_here()
                if j is None:
                    yield TileOutput(self.nxt, pixels.to(shared.device))
                    with self.changed:
                        self.nxt += 1
                    continue
                pixels = self._here(j)
                with self.changed:
                    self.decoded_here += 1
                    if j != self.nxt:
                        self.held[j] = pixels
                        continue
                yield TileOutput(j, pixels)
                with self.changed:
                    self.nxt += 1
        finally:
            with self.changed:
                self.ended = True
                self.changed.notify_all()
            if dispatcher is not None:
                dispatcher.join()
            for o in self.out.values():
                o.close()

    def _next_here(self) -> tuple[int | None, torch.Tensor | None]:
        """(None, output) when the blend's next output is here; else (j, None): decode job j here
        (the blend's next, or one ahead of it while the blend waits for a replica)."""
        context = self.shared.call.context
        with self.changed:
            while True:
                if self.failed is not None:
                    raise self.failed
                if self.nxt in self.held:
                    return None, self.held.pop(self.nxt)
                ahead = [j for j in self.unstarted if j < self.nxt + self.window]
                if ahead:
                    self.unstarted.remove(ahead[0])
                    return ahead[0], None
                context.check("tiles decoded by other replicas")
                self.changed.wait(WAIT_SLICE_S)

    def _here(self, j: int) -> torch.Tensor:
        (pixels,) = self.shared.local.lazy(self.jobs[j])
        return pixels

    # ---- the dispatcher thread -------------------------------------------------------------
    def _dispatch(self) -> None:
        try:
            while not self.ended:
                self._offer_next()
                if not self._sweep():
                    with self.changed:
                        self.changed.wait(DISPATCH_POLL_S)
        except BaseException as error:  # the request's failure (503, a replica's bug): the device raises it
            with self.changed:
                self.failed = error
                self.changed.notify_all()

    def _offer_next(self) -> None:
        with self.changed:
            if self.open is not None or self.ended:
                return
            if self.resend:
                j = self.resend.pop(0)
            else:
                far = [j for j in self.unstarted if self.nxt < j < self.nxt + self.window]
                if not far or self.decoded_here < self.resume_at:
                    return
                j = far[-1]
                self.unstarted.remove(j)
        out = self.shared.offer(self.jobs[j], j)
        with self.changed:
            self.open = self.out[j] = out

    def _sweep(self) -> bool:
        """Take what replicas sent; tiles refused or lost go back. Whether anything came."""
        shared, came = self.shared, False
        with self.changed:
            outs = list(self.out.items())
        for j, o in outs:
            try:
                while shared.pump(o, 0.0):
                    came = True
            except TileRefused:
                came = True
                with self.changed:
                    self._forget(j, o)
                    self.unstarted = sorted([*self.unstarted, j])
                    self.refusals += 1
                    self.resume_at = self.decoded_here + 2 ** (self.refusals - 1)
            except TileLost as error:
                came = True
                shared.lost(j, error)  # a second loss raises (503)
                with self.changed:
                    self._forget(j, o)
                    self.resend.append(j)
            else:
                if o.ended is None:
                    continue
                if not (len(o.chunks) == 1 == o.ended.chunks):
                    shared.lost(j, TileLost("its stream ended without the tile"))
                    with self.changed:
                        self._forget(j, o)
                        self.resend.append(j)
                    continue
                shared.call.replicas.add(o.replica)
                with self.changed:
                    self._forget(j, o)
                    self.held[j] = o.chunks[0]  # on the host until the blend takes it
                    self.refusals = self.resume_at = 0
                    self.changed.notify_all()
            with self.changed:
                if self.open is o and (o.replica is not None or j not in self.out):
                    self.open = None
        return came

    def _forget(self, j: int, o: _Out) -> None:
        """`o` out of the books (under the lock)."""
        self.out.pop(j, None)
        o.close()
        if self.open is o:
            self.open = None


class _LocalRun:
    """A tile decoded here after all, its first `skip` chunks dropped (the blend has them)."""

    def __init__(self, run: Iterator[torch.Tensor]):
        self.run, self.skip = run, 0

    def next(self) -> torch.Tensor | None:
        while self.skip:
            self.skip -= 1
            if next(self.run, None) is None:
                raise RuntimeError("a tile decoded here again gave fewer chunks than its first run")
        return next(self.run, None)

    def close(self) -> None:
        self.run.close()
