"""Custom Serve metrics. Exported to Prometheus with a `ray_` prefix; Serve adds the
deployment, replica and application tags. Names are listed in the README (Deploying) and in
docs/interfaces.md (Metrics)."""

from __future__ import annotations

import functools
from functools import lru_cache

from ray.serve.metrics import Counter, Gauge, Histogram

from vae_service.engine.execution.session import SessionBatchKey
from vae_service.engine.request.decode_request import QUALITIES
from vae_service.names import PRIORITIES
from vae_service.protocol.errors import error_type
from vae_service.serving.scheduling.scheduler import BatchStats, StepScheduler

_BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64]
_LATENCY_MS_BOUNDARIES = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000]


@lru_cache(maxsize=1)
def _metrics() -> dict:
    return {
        "queue": Gauge(
            "vae_queue_depth", description="latent items waiting for a batch, per tier", tag_keys=("model", "tier")
        ),
        "batch": Histogram(
            "vae_batch_size",
            description="latent items per decoder call, per tier",
            boundaries=_BATCH_BOUNDARIES,
            tag_keys=("model", "tier"),
        ),
        "latency": Histogram(
            "vae_decode_latency_ms",
            description="decoder call time per batch, per tier",
            boundaries=_LATENCY_MS_BOUNDARIES,
            tag_keys=("model", "tier"),
        ),
        "rejected": Counter(
            "vae_rejected_requests",
            description="requests answered with an error, by reason",
            tag_keys=("model", "reason"),
        ),
        "folded": Gauge(
            "vae_folded_buffer_bytes", description="bytes held by the fast path's folded weights", tag_keys=("model",)
        ),
        "tiled": Counter(
            "vae_tiled_decodes",
            description="requests decoded in spatial tiles (limits.max_decode_bytes, or out of memory)",
            tag_keys=("model",),
        ),
        "fallback": Counter(
            "vae_precision_fallbacks",
            description="items decoded again in fp32: their fp16/bf16 output was not finite (precision_fallback)",
            tag_keys=("model",),
        ),
        "sessions": Gauge("vae_sessions_open", description="decode sessions open", tag_keys=("model",)),
        "session_connections": Gauge(
            "vae_session_connections",
            description="session connections held (WebSocket, DecodeSession; open or not yet), apart from decode slots",
            tag_keys=("model",),
        ),
        "session_bytes": Gauge(
            "vae_session_held_bytes", description="causal caches held by open sessions (priced)", tag_keys=("model",)
        ),
        "session_expiries": Counter(
            "vae_session_expiries", description="decode sessions freed for being idle", tag_keys=("model",)
        ),
        "chunk": Histogram(
            "vae_session_chunk_ms",
            description="decoder call time per batch of sessions' chunks, per tier",
            boundaries=_LATENCY_MS_BOUNDARIES,
            tag_keys=("model", "tier"),
        ),
        "sink_writes": Gauge(
            "vae_sink_writes",
            description="a sink's writes: in flight, and stuck (abandoned calls whose store has not answered)",
            tag_keys=("model", "sink", "state"),
        ),
        "sink_failures": Counter(
            "vae_sink_failures",
            description="files a sink failed to write, or refused busy",
            tag_keys=("model", "sink", "why"),
        ),
        "class_wait": Histogram(
            "vae_queue_wait_ms",
            description="time a request waited in its class's queue before its batch started, per class",
            boundaries=_LATENCY_MS_BOUNDARIES,
            tag_keys=("model", "priority"),
        ),
        "class_queue": Gauge(
            "vae_class_queue_depth", description="latent items waiting, per class", tag_keys=("model", "priority")
        ),
        "steps": Counter(
            "vae_steps",
            description="device steps run (a batch's decoder calls, latent frames, tiles), per class",
            tag_keys=("model", "priority"),
        ),
        "preemptions": Counter(
            "vae_preemptions",
            description="times a decode was suspended between two steps for more urgent work, per class",
            tag_keys=("model", "priority"),
        ),
        "promotions": Counter(
            "vae_promotions",
            description="classes decodes rose for waiting past scheduling.promote_after_s, per original class",
            tag_keys=("model", "priority"),
        ),
        "suspended": Gauge(
            "vae_suspended_bytes", description="device memory suspended decodes hold (priced)", tag_keys=("model",)
        ),
        "first_frames": Histogram(
            "vae_stream_first_frames_ms",
            description="streamed requests: arrival to the first frames handed over, per tier",
            boundaries=_LATENCY_MS_BOUNDARIES,
            tag_keys=("model", "tier"),
        ),
    }


def report_batch(model: str, stats: BatchStats) -> None:
    tier = stats.key.quality
    m = _metrics()
    m["batch"].observe(stats.items, tags={"model": model, "tier": tier})
    m["chunk" if isinstance(stats.key, SessionBatchKey) else "latency"].observe(
        stats.run_s * 1e3, tags={"model": model, "tier": tier}
    )
    tags = {"model": model, "priority": stats.priority}
    for wait_s in stats.queue_s:
        m["class_wait"].observe(wait_s * 1e3, tags=tags)
    m["steps"].inc(stats.steps, tags=tags)
    if stats.preemptions:
        m["preemptions"].inc(stats.preemptions, tags=tags)
    if stats.promotions:
        m["promotions"].inc(stats.promotions, tags=tags)


def report_sessions(model: str, sessions, expired_before: int) -> None:
    """Open sessions and their held bytes now, and the expiries since `expired_before` was read."""
    m, tags = _metrics(), {"model": model}
    m["sessions"].set(len(sessions.open_sessions), tags=tags)
    m["session_connections"].set(sessions.connections, tags=tags)
    m["session_bytes"].set(sessions.held_bytes, tags=tags)
    if sessions.expired > expired_before:
        m["session_expiries"].inc(sessions.expired - expired_before, tags=tags)


_sink_counts: dict[tuple[str, str, str], int] = {}  # what the failure counters were told so far


def report_sinks(model: str, sinks) -> None:
    """Each sink's writes in flight and stuck now, and its failures and busy refusals since the last report."""
    m = _metrics()
    for name, state in sinks.describe().items():
        for gauge in ("in_flight", "stuck"):
            m["sink_writes"].set(state[gauge], tags={"model": model, "sink": name, "state": gauge})
        for why in ("failed", "refused"):
            key = (model, name, why)
            if state[why] > _sink_counts.get(key, 0):
                m["sink_failures"].inc(
                    state[why] - _sink_counts.get(key, 0), tags={"model": model, "sink": name, "why": why}
                )
                _sink_counts[key] = state[why]


def report_queue(model: str, scheduler: StepScheduler) -> None:
    m = _metrics()
    for tier in QUALITIES:
        depth = scheduler.queued_items(key_filter=functools.partial(_of_tier, tier))
        m["queue"].set(depth, tags={"model": model, "tier": tier})
    for priority in PRIORITIES:
        m["class_queue"].set(scheduler.queued_items(priority), tags={"model": model, "priority": priority})
    m["suspended"].set(scheduler.suspended_bytes(), tags={"model": model})


def _of_tier(tier: str, key) -> bool:
    return key.quality == tier


def report_rejected(model: str, exc: BaseException) -> None:
    _metrics()["rejected"].inc(tags={"model": model, "reason": error_type(exc)})


def report_folded_bytes(engine) -> None:
    _metrics()["folded"].set(engine.fast_path.folded.nbytes, tags={"model": engine.spec.name})


def report_tiled(model: str) -> None:
    _metrics()["tiled"].inc(tags={"model": model})


def report_fallback(model: str, items: int) -> None:
    _metrics()["fallback"].inc(items, tags={"model": model})


def report_first_frames(model: str, quality: str, ms: float) -> None:
    _metrics()["first_frames"].observe(ms, tags={"model": model, "tier": quality})
