"""Decode sessions: a causal video decoder's walk (engine/runtime/wan_walk.py) kept between requests,
so that an autoregressive denoiser's latent chunks decode as they come and their frames, joined, are
the frames of the whole clip.

- Exact: `lossless` walks every session alone with diffusers' arithmetic (each chunk's frames are
  bit-identical to the same frames of `vae.decode` of all the chunks joined, for every chunking);
  `high` stacks the walks of the sessions in one batch on the batch dimension and decodes them in
  one decoder call per latent frame (the fast path's error bound holds per session).
- Atomic: a chunk runs on a fork of its session's walk; its answer carries the step it would take
  (`SessionStep`), which the session's owner applies (`DecodeSession.advance`) only once the answer
  is ready to go (encoded, converted): a chunk stopped by its deadline, its caller leaving, an
  overflow, or a failure after the decode (an encode) leaves the session where it was, usable.
- Bounded: the walk holds two frames of history per causal conv at the session's size, whatever the
  session's length; a stacked batch's histories are copied out per session (`Walk.split`), so a
  session never keeps its batch's alive. That history is priced at open (the tier's `resident`
  bytes, from the meta-device trace) and held in the replica's session budget while it lives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vae_service.engine.execution.call import DecodeCall, checked_chunks
from vae_service.engine.execution.fallback import FALLBACK_PRECISION, Fp32Fallback
from vae_service.engine.execution.video import NON_FINITE
from vae_service.engine.media.postprocess import convert, pixel_form, to_host
from vae_service.engine.request.errors import DecodeAbandoned, DecodeFailed, DecodeTimeout
from vae_service.engine.request.latents import PreparedRequest
from vae_service.engine.request.session import SessionOpen
from vae_service.engine.runtime.runtime import Runtime
from vae_service.engine.runtime.wan_walk import Walk, walk_on


@dataclass(eq=False)
class DecodeSession:
    """One session's state on its replica. `settings` as opened (quality the tier that decodes it);
    `held_price` the bytes its walk holds between chunks, reserved while it is open."""

    id: str
    settings: SessionOpen
    walk: Walk
    held_price: int
    precision: str
    latent_frames: int = 0  # latent frames decoded so far
    frames: int = 0  # frames answered so far
    chunks: int = 0
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a chunk of it is queued or decoding: the next waits (chunks are in order)
    closed: bool = False
    fallback_from_frame: int | None = None  # its first frame decoded at fp32, once it fell back

    @property
    def quality(self) -> str:
        return self.settings.quality

    @property
    def held_bytes(self) -> int:
        return self.walk.held_bytes

    def advance(self, step: SessionStep) -> None:
        """The chunk whose answer is ready to go becomes part of the session (its walk, its counts,
        the precision it decoded at)."""
        self.walk = step.walk
        self.latent_frames += step.latent_frames
        self.frames += step.frames
        self.chunks += 1
        self.precision, self.fallback_from_frame = step.precision, step.fallback_from_frame


@dataclass(frozen=True)
class SessionStep:
    """What a decoded chunk adds to its session: the walk after it, the latent frames and frames it
    decoded, the precision it decoded at (fp32 once the session fell back, from `fallback_from_frame`)."""

    walk: Walk
    latent_frames: int
    frames: int
    precision: str
    fallback_from_frame: int | None


class SessionBatchKey(NamedTuple):
    """Sessions share a decoder call only where nothing that shapes a member's answer differs: tier,
    precision, chunk shape, walk phase, the pixels' form (uint8 or float) and the clip hint the
    post-quant conv's kernel follows (never with requests: their BatchKey is another type)."""

    quality: str
    precision: str
    latent_shape: tuple[int, ...]
    dtype: torch.dtype
    phase: int
    pixels: str
    post_quant: tuple[int | None, int | None]


@dataclass(frozen=True)
class SessionChunk:
    """A session's next latent chunk, checked and priced: what the scheduler queues. `frames`: the output
    frames it adds (the first chunk's first latent frame gives one frame, every later one the law's step)."""

    session: DecodeSession
    prepared: PreparedRequest  # its latents [1, C, t, H, W] in decoder layout, its context
    first_frame: int
    post_quant: tuple[int | None, int | None] = (None, None)  # what its post-quant conv's bits follow (post_quant_key)

    @property
    def items(self) -> int:
        return 1

    @property
    def context(self):
        return self.prepared.context

    @property
    def batch_key(self) -> SessionBatchKey:
        z, session = self.prepared.latents, self.session
        return SessionBatchKey(
            session.quality,
            session.precision,
            tuple(z.shape[1:]),
            z.dtype,
            session.walk.phase,
            pixel_form(session.settings.output),
            self.post_quant,
        )


@dataclass(frozen=True)
class ChunkFrames:
    """A chunk's frames, on the host: uint8 [1, t, H, W, 3] or float [1, 3, t, H, W]; `frame`,
    `latent_frame`: the first of each in the session; `step`: what the session becomes once this
    answer is ready to go (DecodeSession.advance; None for an answer made apart from a decode)."""

    pixels: torch.Tensor
    frame: int
    latent_frame: int
    precision: str
    decode_ms: float
    batch_size: int
    fallback_from_frame: int | None = None  # the session's first fp32 frame, once it fell back
    step: SessionStep | None = field(default=None, repr=False, compare=False)
    preempted_ms: float = 0.0  # its decode suspended between steps while more urgent work ran

    @property
    def frames(self) -> int:
        return self.pixels.shape[1 if self.pixels.dtype == torch.uint8 else 2]


def decode_session_chunks(
    runtime: Runtime, chunks: list[SessionChunk], call: DecodeCall, fallback: Fp32Fallback | None = None
) -> list[ChunkFrames | Exception]:
    """One batch of session chunks (one batch key): `high` stacked in one walk, `lossless` each alone,
    on the fp32 copy for sessions that fell back. The caller holds the tier's gate and inference mode,
    and `call.running()`. `fallback`: where a chunk's frames overflow fp16/bf16, the session goes on
    at fp32 from that chunk (None: the chunk fails, the session stays where it was). No session is
    changed here: each answer's `step` is applied by its owner once the answer is ready to go."""
    start = time.perf_counter()
    if chunks[0].session.fallback_from_frame is not None:
        runtime = fallback.session_runtime()
    together = chunks[0].session.quality == "high"
    groups = [list(range(len(chunks)))] if together else [[i] for i in range(len(chunks))]
    answers: list = [None] * len(chunks)
    for group in groups:
        members = [i for i in group if not call.gone(i)]
        for i in set(group) - set(members):
            answers[i] = call.ended_error(i)
        if not members:
            continue
        call.running_members = tuple(members)
        try:
            decoded = _walk_group(runtime, [chunks[i] for i in members], call)
        except (DecodeAbandoned, DecodeTimeout) as stopped:
            if not (isinstance(stopped, DecodeAbandoned) or all(call.gone(i) for i in members)):
                raise
            for i in members:
                answers[i] = call.ended_error(i)
            continue
        ms = (time.perf_counter() - start) * 1e3
        for i in members:  # each answer converted at once, its float frames dropped
            walk, frames = decoded.pop(0)
            chunk = chunks[i]
            precision, fallback_from = chunk.session.precision, chunk.session.fallback_from_frame
            if not frames.all_finite and fallback is not None and fallback.enabled:
                del frames, walk  # the failed attempt's frames and cache go before the fp32 decode
                walk, frames = _at_fp32(fallback, chunk, call)
                precision, fallback_from = FALLBACK_PRECISION, chunk.first_frame
            step = SessionStep(walk, chunk.prepared.latent_frames, chunk.prepared.frames, precision, fallback_from)
            answers[i] = _answer(chunk, step, frames, ms, len(chunks))
    return answers


def _at_fp32(fallback: Fp32Fallback, chunk: SessionChunk, call: DecodeCall) -> tuple[Walk, Frames]:
    """The chunk decoded again at fp32 from its session's cache before it (engine/execution/fallback.py's
    session_walk); the session goes on at fp32 once it is finite (and its answer goes out)."""
    fp32, session = fallback.session_runtime(), chunk.session
    walk = fallback.session_walk(session.walk)
    z = fallback.latents(chunk.prepared)
    with fp32.gate("lossless"):
        frames = _walked_frames(fp32, walk, z, chunk.prepared.frames, session.settings, call)
    if frames.all_finite:
        fallback.items += 1
    return walk, frames


def _walk_group(runtime: Runtime, group: list[SessionChunk], call: DecodeCall) -> list[tuple[Walk, Frames]]:
    """Each chunk's walk after it and its frames, converted to the session's output (one batch key:
    every member's settings shape its answer as the first's)."""
    zs = [runtime.scaling.to_decoder_input(c.prepared, runtime.device) for c in group]
    walk = Walk.stacked([c.session.walk for c in group])
    z = zs[0] if len(zs) == 1 else torch.cat(zs)
    del zs
    first = group[0]
    frames = _walked_frames(runtime, walk, z, first.prepared.frames, first.session.settings, call)
    return list(zip(walk.split(len(group)), frames.split(), strict=True))


@dataclass
class Frames:
    """A walk's frames in the session's output (uint8 [n, t, H, W, 3] or float [n, 3, t, H, W]), and
    which rows were finite all through."""

    pixels: torch.Tensor
    finite: list[bool]

    def split(self) -> list[Frames]:
        return [Frames(p, [ok]) for p, ok in zip(self.pixels.split(1), self.finite, strict=True)]

    @property
    def all_finite(self) -> bool:
        return all(self.finite)


def _walked_frames(
    runtime: Runtime, walk: Walk, z: torch.Tensor, frames: int, settings: SessionOpen, call: DecodeCall
) -> Frames:
    """The walk's frames of `z`, each latent frame's converted into one output as it comes (as a
    whole answer's are: the chunk's float frames are never all held, nor joined at the end)."""
    pixels, frame, finite, output = None, 0, [True] * z.shape[0], settings.output
    for out in checked_chunks(walk_on(runtime.vae, walk, z, settings.clip_latent_frames), call.checkpoint):
        finite = [ok and bool(torch.isfinite(row).all()) for ok, row in zip(finite, out, strict=True)]
        converted = convert(out, output, runtime.spec.entry.pixels)
        del out
        axis = 1 if converted.dtype == torch.uint8 else 2
        if pixels is None:
            shape = list(converted.shape)
            shape[axis] = frames
            pixels = converted.new_empty(shape)
        pixels.narrow(axis, frame, converted.shape[axis]).copy_(converted)
        frame += converted.shape[axis]
        del converted
    return Frames(pixels, finite)


def _answer(
    chunk: SessionChunk, step: SessionStep, frames: Frames, ms: float, batch: int
) -> ChunkFrames | DecodeFailed:
    """The chunk's answer, holding the step its session takes once the answer goes out; a chunk
    with a frame not finite has none (the session stays where it was)."""
    if not frames.all_finite:
        return DecodeFailed("latents", NON_FINITE + "; the session is where it was before this chunk")
    out = to_host(frames.pixels)
    latent_frame = chunk.session.latent_frames
    return ChunkFrames(out, chunk.first_frame, latent_frame, step.precision, ms, batch, step.fallback_from_frame, step)
