"""A decode replica's behaviour, shared by the plain deployment (handles, gRPC, a routing ingress
in front) and the one that is its own HTTP ingress (deployment.py). Thin: every answer is built
by http_routes, grpc_servicer or handle_api over one DecodeService.

The model, precision, device and fast path are deployment arguments, fixed for the replica's
life: changing them makes Serve roll replicas, so a reply always names the model and precision
that decoded it. `reconfigure` (Serve's user_config) applies limits and batching only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

from ray import serve

from vae_service.config import LIVE_FIELDS, SHUTDOWN_MARGIN_S, LiveConfig, ServiceConfig
from vae_service.protocol.errors import Unauthenticated, wire_error
from vae_service.serving import metrics
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.drain_signal import DrainWatch
from vae_service.serving.scheduling.admission import Admission
from vae_service.serving.scheduling.load_report import load_report
from vae_service.serving.scheduling.tile_peers import ReplicaPeers
from vae_service.serving.sessions.handoff import SessionMoves
from vae_service.serving.sessions.keeper import keeper_handle
from vae_service.serving.viewers.relay import owner_items
from vae_service.serving.wire.grpc_servicer import (
    GrpcAnswer,
    failed,
    frame_events,
    grpc_answer,
    item_events,
    session_replies,
    status_message,
    stream_to,
)
from vae_service.serving.wire.handle_api import handle_decode, handle_decode_frames
from vae_service.serving.wire.http_routes import HttpAnswer, decode_answer, decode_events, remote_decode_answer
from vae_service.serving.wire.proxy_guard import missing_guard_warning
from vae_service.serving.wire.session_socket import SessionCalls
from vae_service.serving.wire.watch_routes import WatchRoutes

log = logging.getLogger("ray.serve")  # Serve writes it to the replica's own log file
KEEPER_RETRY_S = 10.0


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (local testing mode)
        return "local"


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), for /health and soak runs."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def parse_live(
    user_config: dict, deployed: ServiceConfig | None = None, serve_options: dict | None = None
) -> LiveConfig:
    """A user_config as live settings. `deployed`: the deployment's arguments, from which Serve's
    options were derived at deploy (`serve_options`: the ones Serve enforces); a live change that
    would contradict them is refused, naming the field, rather than applied where Serve would then
    throttle batches or kill a draining replica with its requests."""
    fixed = sorted(k for k in user_config if k in ServiceConfig.model_fields and k not in LIVE_FIELDS)
    if fixed:
        raise ValueError(
            f"user_config: {fixed} are fixed for a replica's life (deployment arguments); change the "
            f"application's args to roll replicas. user_config takes only {list(LIVE_FIELDS)}"
        )
    live = LiveConfig.model_validate(user_config)
    if deployed is not None:
        _check_against_deploy(live, deployed, serve_options or {})
    return live


def _check_against_deploy(live: LiveConfig, deployed: ServiceConfig, serve_options: dict) -> None:
    batching, at_deploy = live.batching, deployed.batching
    if batching.request_timeout_s > at_deploy.request_timeout_s:
        raise ValueError(
            f"user_config: batching.request_timeout_s {batching.request_timeout_s:g} is over the "
            f"{at_deploy.request_timeout_s:g} s it was at deploy, from which Serve's graceful_shutdown_timeout_s "
            "was derived (a draining replica would be killed with its requests): change it in args to redeploy"
        )
    ongoing = serve_options.get("max_ongoing_requests")
    keys = deployed.serving.concurrent_keys
    if ongoing is not None and batching.max_batch_size * keys > ongoing:
        raise ValueError(
            f"user_config: batching.max_batch_size {batching.max_batch_size} x serving.concurrent_keys {keys} is "
            f"over this deployment's max_ongoing_requests {ongoing}, fixed at deploy (batches could never fill): "
            "change it in args to redeploy"
        )


def drain_timeout_s(live: LiveConfig, serve_options: dict) -> float:
    """How long shutdown waits for queued and running decodes: the requests' own timeout, within
    what Serve enforces (graceful_shutdown_timeout_s, less the drain's own bookkeeping)."""
    enforced = serve_options.get("graceful_shutdown_timeout_s")
    timeout = live.batching.request_timeout_s
    return timeout if enforced is None else max(0.0, min(timeout, enforced - SHUTDOWN_MARGIN_S))


class DecoderReplica:
    def __init__(self, config: dict | ServiceConfig, serve_options: dict | None = None):
        """`serve_options`: the Serve options this deployment runs with (serving/app.py)."""
        config = ServiceConfig.model_validate(config)
        self.deployed, self.serve_options = config, dict(serve_options or {})
        self.admission = Admission.from_config(config)  # the token; HTTP routes also its body limits
        peers = ReplicaPeers(config.serving.retry_after_s) if config.parallel.tiles_across_replicas else None
        self.service = DecodeService(
            config,
            peers=peers,
            on_batch=self._observe_batch,
            on_rejected=self._count_rejected,
            on_decoded=self._observe_result,
            on_first_frames=self._observe_first_frames,
            owner=replica_id,
        )
        self.session_calls = SessionCalls(self.service)
        self.watch_routes = WatchRoutes(self.service, self.admission, replica_id)
        self.watch_routes.remote, self.watch_routes.remote_delete = self._relayed_stream, self._relayed_delete
        self._keeper, self._keeper_tried_at = None, None
        self.service.session_moves = SessionMoves(self.service.sessions, self._session_keeper, replica_id)
        self._drain_watch = DrainWatch(self._hand_off_sessions)
        self._expired_reported = 0
        engine = self.service.engine
        self.model = engine.spec.name
        d = engine.describe()  # one short line; the whole description is GET /health
        log.info(
            "serving %s (%s, %s weights) at %s on %s, tiers %s",
            d["model"], d["class"], "random" if engine.spec.random_weights else "loaded", d["precision"],
            d["device"], "/".join(d["tiers"]),
        )  # fmt: skip
        if (warning := missing_guard_warning()) is not None:
            log.warning(warning)
        metrics.report_folded_bytes(self.service.engine)
        self.service.sinks.on_change = functools.partial(metrics.report_sinks, self.model, self.service.sinks)
        self.service.sessions.on_change = self._report_sessions

    @property
    def config(self) -> ServiceConfig:
        return self.service.config

    def reconfigure(self, user_config: dict) -> None:
        self.service.apply(parse_live(user_config, self.deployed, self.serve_options))
        # at start-up and on every change: the settings that differ from the defaults (all: /health)
        changed = self.service.live.model_dump(exclude_defaults=True)
        log.info("live settings: %s", changed or "the defaults")

    def _observe_batch(self, stats) -> None:
        metrics.report_batch(self.model, stats)
        self._report_sessions()
        metrics.report_folded_bytes(self.service.engine)
        metrics.report_queue(self.model, self.service.scheduler)

    def _report_sessions(self) -> None:
        sessions = self.service.sessions
        metrics.report_sessions(self.model, sessions, self._expired_reported)
        self._expired_reported = sessions.expired
        if sessions.open_sessions:
            with contextlib.suppress(RuntimeError):  # called off the replica's loop: the next call starts it
                self._drain_watch.ensure_running()

    def _session_keeper(self):
        """The deployment's session keeper (sessions/keeper.py), started on first use; None outside
        a Serve replica or where it cannot be reached (sessions then neither leave nor come)."""
        now = time.monotonic()
        if self._keeper is None and (self._keeper_tried_at is None or now - self._keeper_tried_at > KEEPER_RETRY_S):
            self._keeper_tried_at = now
            try:
                context = serve.get_replica_context()
                self._keeper = keeper_handle(context.app_name, context.deployment)
            except Exception as exc:
                log.warning("no session keeper yet (%s): asked again in %g s", exc, KEEPER_RETRY_S)
        return self._keeper

    async def _hand_off_sessions(self) -> None:
        """The drain has begun: every open session goes to the keeper, its client told `moved`."""
        moves = self.service.session_moves
        self.watch_routes.drain()
        outcome = await moves.hand_off_all(drain_timeout_s(self.service.live, self.serve_options))
        if outcome["handed_off"] or outcome["failed"]:
            log.info("replica %s drains: sessions handed on %s", replica_id(), outcome)

    def _count_rejected(self, exc: BaseException) -> None:
        metrics.report_rejected(self.model, exc)

    def _observe_result(self, result) -> None:
        if result.tiled:
            metrics.report_tiled(self.model)
        if result.fallback:
            metrics.report_fallback(self.model, len(result.fallback))

    def _observe_first_frames(self, quality: str, ms: float) -> None:
        metrics.report_first_frames(self.model, quality, ms)

    async def record_routing_stats(self) -> dict:
        """Serve polls it for the request router (serving/scheduling/class_router.py); on the replica's
        loop, where the scheduler's queues change."""
        return self.service.routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve polls it for the deployment's autoscaling policy (serving/autoscaling_policy.py):
        what limits this replica over the window, on the replica's loop (serving/scheduling/load_report.py)."""
        return load_report(self.service)

    def check_health(self) -> None:
        self.service.engine.check_device()

    def describe(self) -> dict:
        self._report_sessions()  # opened and freed without a batch since (rejected, closed, expired)
        described = self.service.describe()
        described["sessions"] = {**described.get("sessions", {}), **self.service.session_moves.describe()}
        described["viewers"] = self.service.sessions.viewers.describe()
        return {"replica": replica_id(), "rss_bytes": resident_bytes(), **described}

    # ---- bodies, also called through handles by the routing ingress ----------------------------
    async def decode_body(self, body: bytes, content_type: str | None) -> HttpAnswer:
        return await decode_answer(self.service, body, content_type)

    async def decode_body_events(self, body: bytes, content_type: str | None):
        """A /decode body with `stream: true` (called through a streaming handle)."""
        async for event in decode_events(self.service, body, content_type):
            yield event

    async def remote_decode_body(
        self, body: bytes, content_type: str | None, accept: str | None, query: dict[str, list[str]]
    ) -> HttpAnswer:
        return await remote_decode_answer(self.service, body, content_type, accept, query)

    # ---- gRPC: methods named like the RPCs of vae_service.v1.VaeDecoder ----------------------
    async def grpc_unary(self, request) -> GrpcAnswer:
        return await grpc_answer(self.service, request)

    async def grpc_item_events(self, request):
        """DecodeStream's messages (also through a streaming handle from a routing ingress)."""
        async for event in item_events(self.service, request):
            yield event

    async def grpc_frame_events(self, request):
        """DecodeFrames' messages (also through a streaming handle from a routing ingress)."""
        async for event in frame_events(self.service, request):
            yield event

    async def Decode(self, request, grpc_context):  # noqa: N802 (the RPC's name)
        try:
            self.admission.check_grpc(grpc_context)
        except Unauthenticated as exc:
            return failed(self.service.rejected(exc)).unary(grpc_context)
        return (await self.grpc_unary(request)).unary(grpc_context)

    async def DecodeStream(self, request, grpc_context):  # noqa: N802
        async for message in self._stream("DecodeStream", self.grpc_item_events(request), grpc_context):
            yield message

    async def DecodeFrames(self, request, grpc_context):  # noqa: N802
        async for message in self._stream("DecodeFrames", self.grpc_frame_events(request), grpc_context):
            yield message

    async def DecodeSession(self, requests, grpc_context):  # noqa: N802
        """A decode session for the stream's life, on this replica (docs/interfaces.md)."""
        admit = functools.partial(self.admission.check_grpc, grpc_context)
        async for reply in session_replies(self.service, admit, requests, grpc_context):
            yield reply

    async def _stream(self, rpc: str, events, grpc_context):
        try:
            self.admission.check_grpc(grpc_context)
        except Unauthenticated as exc:
            await events.aclose()
            yield status_message(grpc_context, wire_error(self.service.rejected(exc)), rpc)
            return
        async for message in stream_to(grpc_context, events, rpc):
            yield message

    # ---- composition -----------------------------------------------------------------------
    async def decode(self, latents, quality: str = "lossless", output: str = "uint8", **options) -> dict:
        """`latents` a torch tensor or numpy array; options are the /decode keys (scaling_factor,
        shift_factor, height, width, request_id, model, priority, ...). Returns the /decode response fields with
        `output` as a numpy array (bf16 as float32) or a list of bytes."""
        return await handle_decode(self.service, latents, quality=quality, output=output, **options)

    async def decode_frames(self, latents, quality: str = "lossless", output: str = "uint8", **options):
        """Video frames as they are decoded, through `handle.options(stream=True)`: dicts like the
        HTTP stream's messages (vae_service_client.frames) with `pixels` as numpy arrays."""
        async for message in handle_decode_frames(self.service, latents, quality=quality, output=output, **options):
            yield message

    # ---- decode sessions (pinned to this replica by serving/scheduling/session_router.py) -----------------
    async def open_session(self, **settings) -> dict:
        """A decode session on this replica: `height`, `width` (the latents'), and `quality`,
        `output`, `dtype`, the factors, `request_id`, `priority` as the WebSocket's open message. Returns the
        `opened` summary; its `session` id goes with every later call, as
        `handle.options(session_id=sid)` (which keeps the calls on this replica)."""
        return await self.session_calls.open(**settings)

    async def decode_chunk(self, session: str, latents, latent_frame: int | None = None) -> dict:
        """The session's next latent chunk [1, C, t, H, W]: {item, frame, pixels (numpy)} or
        {fragments: [...]} (mp4/webm), with `done` (the WebSocket's chunk_done)."""
        return await self.session_calls.chunk(session, latents, latent_frame)

    async def close_session(self, session: str) -> dict | None:
        return await self.session_calls.close(session)

    # ---- viewers that landed on another replica (serving/viewers/relay.py) -----------------------
    async def watch_feed(self, watch: str, token: str | None, kind: str):
        """A viewer's stream of a session watched here by its watch id, for the replica the viewer
        landed on (a streaming handle pinned here by `session_id=watch`: the watch id begins with the
        replica's, as a session's does); it holds a session connection here while it lasts."""
        sessions = self.service.sessions

        def hold():
            sessions.connect()
            return sessions.disconnect

        async for item in owner_items(sessions.viewers, watch, token, kind, hold):
            yield item

    async def close_whep(self, session: str, token: str | None) -> bool | None:
        """A WHEP viewer's DELETE that landed on another replica (`session`: the resource, which
        names this replica)."""
        return await self.watch_routes.close_peer(session, token)

    def _own_deployment(self):
        context = serve.get_replica_context()
        return serve.get_deployment_handle(context.deployment, context.app_name)

    def _relayed_stream(self, watch: str, token: str | None, kind: str):
        handle = self._own_deployment().options(stream=True, session_id=watch)
        return handle.watch_feed.remote(watch=watch, token=token, kind=kind)

    async def _relayed_delete(self, resource: str, token: str | None) -> bool | None:
        return (
            await self._own_deployment().options(session_id=resource).close_whep.remote(session=resource, token=token)
        )

    async def decode_tile_job(self, job, fingerprint: str, remaining_s: float):
        """A tile of another replica's request (engine/runtime/tile_jobs.py), through a streaming handle:
        `OfferRefused` at once unless this replica is free for it, else `Accepted`, its output chunk by
        chunk on the device thread, `End` (DecodeService.tile)."""
        async for message in self.service.tile(job, fingerprint, remaining_s, replica_id()):
            yield message

    def release_folded(self) -> int:
        """Drop the fast path's folded weights and the fp32 fallback's weights now (the next decode
        that needs them makes them again)."""
        freed = self.service.release_folded()
        metrics.report_folded_bytes(self.service.engine)
        return freed

    async def __del__(self) -> None:
        # Serve calls this on scale-down, redeploy, delete and shutdown (not on a hard kill), and
        # also after an __init__ that raised: then there is nothing to drain, and touching the
        # missing service would log a second, unrelated traceback after the real one
        if "service" not in self.__dict__:
            return
        # sessions held by no connection (handles) leave now; then queued and running batches
        # finish, and the folded buffers go back
        await self._hand_off_sessions()
        await self.watch_routes.close_all()
        drained = await self.service.drain(drain_timeout_s(self.service.live, self.serve_options))
        freed = self.release_folded()
        log.info(
            "replica %s shutting down: drained=%s, released %d bytes of folded buffers and fp32 fallback weights",
            replica_id(),
            drained,
            freed,
        )
