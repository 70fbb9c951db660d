"""One tile mechanism: a request's tile jobs (engine/tile_jobs.py) decoded by an executor that yields
their outputs in the order the blend reads them, for images and video alike. Two executors:

- `LocalTiles`: on this device, lazily: a job runs when the blend first reads it, so images and
  video tile after tile hold one tile's working set at a time (video in lockstep holds every
  tile's causal history);
- `SharedTiles`: the deployment's replicas (the serving layer's `TilePeers`; the engine never
  imports Ray) and this device together. A tile goes to a replica only through its free slot: a
  replica takes a tile only while its device is idle, one at a time, planned for its own bound
  (serving/tile_peers.py), and otherwise refuses it at once; this device decodes every tile no
  replica took, and meanwhile the tiles ahead of the blend, so a saturated deployment decodes as
  if nothing were shared. Every replica with the request's fingerprint decodes a job to the same
  bits, so the answer is the one `LocalTiles` gives.

Order: one output per job in job order (images, the class's own tiled decode); video tiles of a
tier one chunk per latent frame, in lockstep (chunk k of every tile before chunk k+1 of any) or,
here only, tile after tile. Remote means lockstep: a tile's history stays where it is decoded, and
this device holds only the blend.

Bounds: at most `TILE_WINDOW` jobs between the blend and the furthest tile decoding; what is held
meanwhile (at most `TILE_WINDOW - 1` finished outputs) is counted in the plan
(CostModel.held_while_tiled). Failures: a refusal (no free slot, another fingerprint, no time left,
over its bound) decodes the tile here; a lost tile (the replica went away, was overloaded, or its
stream ended short) is decoded once more, by a replica that takes it or here, and a second loss
answers 503 (`Unavailable`); anything else a replica raised is a bug, 500 (`TileBug`). None of
these fails the batch: the request alone gets the error (the batcher never re-runs it). Every
wait checks the request in slices (engine/context.py): a caller that leaves, or the deadline,
stops it within one, and every tile still out is cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from vae_service.engine.call import TileCall
from vae_service.engine.context import WAIT_SLICE_S
from vae_service.engine.errors import Unavailable
from vae_service.engine.runtime import Runtime
from vae_service.engine.tile_jobs import TileJob, gives_chunks

log = logging.getLogger(__name__)

TILE_WINDOW = 8  # jobs from the blend's to the furthest decoding: at most this many held or out
OFFER_WAIT_S = 0.5  # an offer no replica has taken by then (Serve still routing it) is decoded here
STREAM_REFUSALS = 2  # video tiles are offered at the start until this many were refused


@dataclass(frozen=True)
class TileOutput:
    job: int  # the job's index in the run
    pixels: torch.Tensor  # on this device


class TileExecutor(Protocol):
    def run(self, jobs: list[TileJob], lockstep: bool = True, optional: bool = False) -> Iterator[TileOutput]:
        """Every job's output in blend order. `optional`: the tiles are worth it only if other replicas
        decode some (a request that fits whole); raises NotShared before any work when none will."""


# ---- what a replica answers about a tile it was offered (serving/tile_peers.py) ---------------
@dataclass(frozen=True)
class Accepted:
    replica: str


@dataclass(frozen=True)
class Chunk:
    pixels: torch.Tensor


@dataclass(frozen=True)
class End:
    chunks: int  # how many it sent: fewer read means the stream ended short


@dataclass(frozen=True)
class Refused:
    """The replica did not take the tile, and why (the transport raises TileRefused for it)."""

    reason: str


@dataclass(frozen=True)
class Lost:
    """The replica took the tile and could not finish it (out of memory): TileLost."""

    reason: str


class TileRefused(Exception):
    """The replica did not take the tile (no free slot, another fingerprint, no time left, over its
    own bound): it is decoded here."""


class TileLost(Exception):
    """The replica went away, was overloaded, or the stream ended short: the tile is decoded once more."""


class TileBug(RuntimeError):
    """A replica failed a tile for a reason that is not the request's nor the deployment's (a bug):
    the request answers 500, the replica's log has the traceback."""


class NotShared(Exception):
    """An optional tiling found no replica to share it with: the request decodes whole."""


class RemoteTile(Protocol):
    def poll(self, timeout_s: float) -> Accepted | Chunk | End | None:
        """The next message within `timeout_s` (None: none yet); raises TileRefused, TileLost, or
        anything else for a bug."""

    def cancel(self) -> None:
        """Stop it there (a no-op once ended)."""


class TilePeers(Protocol):
    retry_after_s: float  # what a request that lost a tile twice is told to wait

    def offer(self, job: TileJob, call: TileCall) -> RemoteTile:
        """Send `job` to a replica of the deployment (it answers Accepted, or refuses)."""


# ---- here -------------------------------------------------------------------------------------
class LocalTiles:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def lazy(self, job: TileJob) -> Iterator[torch.Tensor]:
        yield from self.runtime.run_job(job)  # started when first read

    def run(self, jobs: list[TileJob], lockstep: bool = True, optional: bool = False) -> Iterator[TileOutput]:
        if optional:
            raise NotShared
        runs = [self.lazy(job) for job in jobs]
        try:
            if not lockstep:
                for j, run in enumerate(runs):
                    for pixels in run:
                        yield TileOutput(j, pixels)
                return
            while True:
                step = [next(run, None) for run in runs[:1]]
                if step[0] is None:
                    _all_ended(runs[1:])
                    return
                yield TileOutput(0, step[0])
                for j, run in enumerate(runs[1:], 1):
                    pixels = next(run, None)
                    if pixels is None:
                        raise RuntimeError(f"tile {j} ended before tile 0 (tiles of one grid give as many chunks)")
                    yield TileOutput(j, pixels)
        finally:
            for run in runs:
                run.close()


def _all_ended(runs: list[Iterator[torch.Tensor]]) -> None:
    if any(next(run, None) is not None for run in runs):
        raise RuntimeError("tile 0 ended before the others (tiles of one grid give as many chunks)")


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

    def run(self, jobs: list[TileJob], lockstep: bool = True, optional: bool = False) -> Iterator[TileOutput]:
        if jobs and gives_chunks(jobs[0], self.local.runtime.chunked):
            if not lockstep:
                raise ValueError("tiles on other replicas run in lockstep: their histories stay there")
            return self._streams(jobs, optional)
        return _Outputs(self, jobs).run(optional)

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

    def answered(self, out: _Out) -> bool:
        """Wait (in slices that check the request) until `out` is accepted; False if refused."""
        try:
            self.call.context.wait_until(lambda s: self.pump(out, s) and out.replica is not None, "a tile's offer")
        except TileRefused:
            return False
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
                if self.answered(out):
                    sources[j] = out
                elif (refused := refused + 1) == STREAM_REFUSALS:
                    break
            if optional and all(source is None for source in sources):
                raise NotShared
            for j in range(n):
                if sources[j] is None:
                    sources[j] = _LocalRun(self.local.lazy(jobs[j]))
            while True:
                for j in range(n):
                    pixels = self._next_chunk(jobs, sources, j)
                    if pixels is None:
                        if j or any(self._next_chunk(jobs, sources, k) is not None for k in range(1, n)):
                            raise RuntimeError("the tiles of one grid gave different numbers of chunks")
                        return
                    yield TileOutput(j, pixels)
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
                sources[j] = again if self.answered(again) else _LocalRun(self.local.lazy(jobs[j]))
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
    """One run of single-output jobs shared with replicas: this device decodes from the blend's end
    of the window, replicas take jobs from its far end, one offer open at a time (each routed before
    the next). A refusal pauses the offers for as many tiles decoded here as 2 ** (refusals in a
    row - 1): a busy deployment is asked less and less; a tile out that comes back (a slot freed)
    ends the pause."""

    def __init__(self, shared: SharedTiles, jobs: list[TileJob]):
        self.shared, self.jobs = shared, jobs
        self.unstarted = list(range(len(jobs)))
        self.out: dict[int, _Out] = {}  # given to replicas, not back yet
        self.held: dict[int, torch.Tensor] = {}  # outputs the blend has not reached
        self.open: _Out | None = None  # the offer not answered yet
        self.pause = 0  # tiles this device decodes before the next offer
        self.refusals = 0  # in a row
        self.resend: list[int] = []  # lost: offered once more before this device takes them

    def run(self, optional: bool) -> Iterator[TileOutput]:
        shared, n = self.shared, len(self.jobs)
        try:
            if optional:  # the window's far end, answered before any work here
                far = min(n, TILE_WINDOW) - 1
                first = shared.offer(self.jobs[far], far)
                if not shared.answered(first):
                    raise NotShared
                self.unstarted.remove(far)
                self.out[far] = first
            nxt = 0
            while nxt < n:
                self._sweep(0.0)
                window = [j for j in self.unstarted if j < nxt + TILE_WINDOW]
                if self.open is None and self.resend:
                    j = self.resend.pop(0)
                    self.open = self.out[j] = shared.offer(self.jobs[j], j)
                elif self.open is None and not self.pause and window and window[-1] != nxt:
                    self.open = self.out[window[-1]] = shared.offer(self.jobs[window[-1]], window[-1])
                    self.unstarted.remove(window[-1])
                if nxt in self.held:
                    yield TileOutput(nxt, self.held.pop(nxt))
                    nxt += 1
                elif self.open is not None and window:  # its answer first: another offer may follow
                    shared.call.context.check("a tile's offer")
                    self._sweep(WAIT_SLICE_S, only=self.open)
                elif nxt in self.unstarted:
                    self.unstarted.remove(nxt)
                    yield TileOutput(nxt, self._here(nxt))
                    nxt += 1
                elif window:  # the blend waits for a replica: a tile ahead meanwhile
                    self.unstarted.remove(window[0])
                    self.held[window[0]] = self._here(window[0])
                else:
                    shared.call.context.check("tiles decoded by other replicas")
                    self._sweep(WAIT_SLICE_S, only=self.out[nxt])
        finally:
            for o in self.out.values():
                o.close()

    def _here(self, j: int) -> torch.Tensor:
        (pixels,) = self.shared.local.lazy(self.jobs[j])
        self.pause = max(0, self.pause - 1)
        return pixels

    def _sweep(self, timeout_s: float, only: _Out | None = None) -> None:
        """Take what replicas sent (waiting up to `timeout_s` on `only`); tiles refused or lost go
        back to the unstarted."""
        shared = self.shared
        for j, o in list(self.out.items()):
            if only is not None and o is not only:
                continue
            try:
                while shared.pump(o, timeout_s) and o.ended is None:
                    timeout_s = 0.0
            except TileRefused:
                self.refusals += 1
                self.pause = 2 ** (self.refusals - 1)
                self._back(j)
            except TileLost as error:
                self._lost(j, error)
            else:
                if o.ended is not None:
                    if len(o.chunks) == 1 == o.ended.chunks:
                        self.held[j] = shared.used(o, o.chunks[0])
                        self.pause = self.refusals = 0
                        del self.out[j]
                    else:
                        self._lost(j, TileLost("its stream ended without the tile"))
            if self.open is o and (o.replica is not None or j not in self.out):
                self.open = None

    def _lost(self, j: int, error: TileLost) -> None:
        self.shared.lost(j, error)
        self.out.pop(j).close()
        self.resend.append(j)

    def _back(self, j: int) -> None:
        self.out.pop(j).close()
        self.unstarted.append(j)
        self.unstarted.sort()


class _LocalRun:
    """A tile decoded here after all, its first `skip` chunks dropped (the blend has them)."""

    def __init__(self, run: Iterator[torch.Tensor]):
        self.run, self.skip = run, 0

    def next(self) -> torch.Tensor | None:
        while self.skip:
            self.skip -= 1
            next(self.run)
        return next(self.run, None)

    def close(self) -> None:
        self.run.close()
