"""A decode session as plain data, to leave its replica: handed to another when its replica drains
(a scale-down, a rolling update), or checkpointed so that a crash costs only the chunks since.

The state is the session's causal walk (each causal conv's history, by the conv's module name, on
the host), its counts and settings, and the engine's fingerprint: only an engine that decodes the
same bits (same weights, precision, fast path) may take it in, so a session continued elsewhere
gives the frames it would have given at home. A walk's history tensors are never written after they
are made (wan_walk.Walk), so a copy taken between two chunks is a consistent snapshot even while
the next chunk runs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vae_service.engine.execution.session import DecodeSession
from vae_service.engine.request.session import SessionOpen
from vae_service.engine.runtime.wan_walk import Walk


@dataclass(frozen=True)
class VideoState:
    """A session's mp4/webm file so far: its init segment and what its answered fragments hold (a
    writer continued from these writes the fragments the first would have)."""

    init: bytes | None
    frames: int
    fragments_sent: int


@dataclass(frozen=True)
class SessionState:
    id: str
    settings: SessionOpen
    fingerprint: str
    history: dict[str, torch.Tensor]  # conv module name -> its history, on the host (strides kept)
    started_upsamplers: tuple[str, ...]
    first_chunk: bool
    steps: int
    latent_frames: int
    frames: int
    chunks: int
    precision: str
    fallback_from_frame: int | None
    video: VideoState | None = None
    # what the serving layer keeps with the session (where its frames go, its viewers' token):
    # carried along untouched, as (name, value) pairs so the state stays hashable plain data
    delivery: tuple[tuple[str, object], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.history.values())

    def with_video(self, video: VideoState | None, delivery: dict | None = None) -> SessionState:
        return replace(self, video=video, delivery=tuple(sorted((delivery or {}).items())))


def export_state(session: DecodeSession, fingerprint: str) -> SessionState:
    """The session as it stands after its last applied chunk, its history copied to the host (own
    storage each: a view would carry its whole batch's storage along)."""
    walk = session.walk
    names = {module: name for name, module in walk.d.named_modules()}
    history = {names[conv]: t.detach().to("cpu", copy=True) for conv, t in walk.history.items()}
    return SessionState(
        session.id,
        session.settings,
        fingerprint,
        history,
        tuple(sorted(names[m] for m in walk.started_upsamplers)),
        walk.first_chunk,
        walk.steps,
        session.latent_frames,
        session.frames,
        session.chunks,
        session.precision,
        session.fallback_from_frame,
    )


def restore_walk(state: SessionState, fresh: Walk, device: torch.device) -> Walk:
    """`fresh` (a new walk on the decoder that continues the session) holding the state's history."""
    modules = dict(fresh.d.named_modules())
    missing = sorted((set(state.history) | set(state.started_upsamplers)) - set(modules))
    if missing:
        raise ValueError(f"the session's state names modules this decoder has not: {missing[:3]}")
    walk = fresh.fork()
    walk.history = {modules[name]: t.to(device) for name, t in state.history.items()}
    walk.started_upsamplers = {modules[name] for name in state.started_upsamplers}
    walk.first_chunk, walk.steps = state.first_chunk, state.steps
    return walk
