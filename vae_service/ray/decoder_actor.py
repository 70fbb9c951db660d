"""The decode service as a plain Ray actor, for pipelines built on Ray actors (Ray DAGs, compiled
graphs) rather than Serve: a denoiser actor hands its latents to a decoder actor.

It runs the same DecodeService a Serve replica runs (one engine, tier-keyed batching, one device
thread, the encoder pool) on an event loop of its own, so calls made concurrently (the actor is
threaded) batch by tier exactly as HTTP requests do. Arguments, answers and errors are those of
the Serve handle API: `decode(latents, quality=..., output=..., **options)` returns the /decode
response fields, and bad input raises vae_service_client's typed errors (InvalidRequest, ...).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any

import ray

from vae_service.config import ServiceConfig
from vae_service.engine.request.errors import Overloaded
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.viewers.feed import STREAM
from vae_service.serving.viewers.relay import owner_items
from vae_service.serving.wire.handle_api import handle_decode
from vae_service.serving.wire.session_socket import SessionCalls

# under Ray's own logger, which Ray workers write to their log files (a bare logger's INFO is dropped)
log = logging.getLogger("ray.vae_service")

# calls in flight at once per actor: enough for concurrent callers to fill a batch; compiled
# graphs run their own loop beside them
MAX_CONCURRENCY = 16
MAX_WATCHES = MAX_CONCURRENCY // 4  # viewers' streams (`watch`), each holding a thread while it lasts


class Decoder:
    """Works in-process as well; `DecoderActor` is this class as a Ray actor."""

    def __init__(self, config: dict | ServiceConfig):
        config = ServiceConfig.model_validate(config)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="vae-decoder-loop", daemon=True)
        self._loop_thread.start()
        self._closed = False
        self._watches, self._watch_lock = 0, threading.Lock()
        self.service: DecodeService = self._run(_start_service(config))
        self._sessions = SessionCalls(self.service, self.service.engine.device)
        log.info("decoder actor serving %s", self.service.engine.describe())

    def _run(self, coroutine: Coroutine) -> Any:
        if self._closed:
            coroutine.close()
            raise RuntimeError("this decoder is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> dict:
        """`latents` a torch tensor (CPU or GPU) or numpy array; options are the /decode keys
        (`priority`: the scheduler's class, realtime | interactive | bulk; absent: the default).
        Returns the /decode response fields with `output` a numpy array or a list of bytes."""
        device = self.service.engine.device  # latents a compiled graph put on our GPU stay there
        return self._run(handle_decode(self.service, latents, device, quality=quality, output=output, **options))

    # ---- decode sessions: this actor is the affinity (serving/wire/session_socket.py's SessionCalls) ----
    def open_session(self, **settings) -> dict:
        """A decode session (`height`, `width`, `quality`, `output`, `dtype`, factors, `priority`): its summary."""
        return self._run(self._sessions.open(**settings))

    def decode_chunk(self, session: str, latents, latent_frame: int | None = None) -> dict:
        """The session's next latent chunk [1, C, t, H, W]: its frames (numpy) with `done`."""
        return self._run(self._sessions.chunk(session, latents, latent_frame))

    def close_session(self, session: str) -> dict | None:
        return self._run(self._sessions.close(session))

    def watch(self, watch_id: str, token: str | None = None):
        """A viewer of a session opened with `watch=True` (by its `opened.watch` id), for a Ray caller (call it with
        `.options(num_returns="streaming")`): `joined` (or `refused`), then `start` (the file's
        init segment and content type) and each `fragment` (serving/viewers/feed.py's Fragment:
        one latent frame's mp4/webm fragment), then `ended`. Each watch holds one of the actor's
        threads while it lasts: at most MAX_WATCHES at once (`refused`: `viewers`), so decodes keep
        theirs. Ray hands the items on as they come: a caller that reads slowly holds them in the
        object store (pass `_generator_backpressure_num_objects` to bound them)."""

        def hold():
            with self._watch_lock:
                if self._watches >= MAX_WATCHES:
                    raise Overloaded(
                        "viewers", f"{MAX_WATCHES} watches of this actor are open: retry when one ends", 1.0
                    )
                self._watches += 1

            def release():
                with self._watch_lock:
                    self._watches -= 1

            return release

        items = owner_items(self.service.sessions.viewers, watch_id, token, STREAM, hold)
        try:
            while True:
                try:
                    item = self._run(items.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._closed:
                self._run(items.aclose())

    def describe(self) -> dict:
        return {"pid": os.getpid(), **self.service.describe()}

    def release_folded(self) -> int:
        """Drop the fast path's folded weights now (the next `high` decode rebuilds them); bytes freed."""
        return self.service.release_folded()

    def close(self, timeout_s: float | None = None) -> int:
        """Finish queued and running decodes, then give the folded buffers back; bytes freed.
        Ray calls it when the actor exits gracefully (its handles go out of scope,
        `__ray_terminate__`); `ray.kill` ends the process and the memory with it."""
        if self._closed:
            return 0
        timeout_s = self.service.config.batching.request_timeout_s if timeout_s is None else timeout_s
        drained = self._run(self.service.drain(timeout_s))
        self._run(_cancel_other_tasks())  # the scheduler's idle workers
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        freed = self.service.release_folded()
        log.info("decoder actor closing: drained=%s, released %d bytes of folded buffers", drained, freed)
        return freed

    def __ray_shutdown__(self) -> None:
        self.close()


# module functions, not methods: Ray makes an actor with any coroutine method an asyncio actor,
# whose plain methods would then run one at a time on its event loop
async def _start_service(config: ServiceConfig) -> DecodeService:
    return DecodeService(config)  # built on the loop its scheduler runs on


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


DecoderActor = ray.remote(max_concurrency=MAX_CONCURRENCY)(Decoder)
