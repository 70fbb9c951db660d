"""DecodeEngine: one VAE on one device at one precision, fixed for its lifetime; prepares requests
and decodes homogeneous batches. A facade over four parts, each with one job:

- the runtime (engine/runtime/runtime.py): the model on its device, its fast path and the decode primitives;
- the cost model (engine/pricing/cost_model.py): a request's limits and peak memory, from numbers fixed
  at start-up, in constant work per request;
- the planner (engine/planning/planner.py): how a request decodes within the bound, and how a batch runs;
- the executor (engine/execution/executor.py): the plan's decode, with the call's own state.

Tiers:
- `lossless` decodes every latent alone (a batch of one) with diffusers' own modules, so each
  item is bit-identical to `vae.decode` of that latent alone whatever it was batched with;
  batched convolutions are not batch-invariant on every backend (on our CPU a batched 1x1
  conv already differs in the last bits). Above the bound: the class's own tiled decode.
- `high` decodes the batch in one call with the fast path's gate on (see fastpath/). A model
  without a fast path answers `high` requests with `lossless`, and says so in the answer. Above
  the bound: spatial tiles.
- `preview` maps the batch's latents to pixels with a linear map or a tiny decoder
  (engine/runtime/preview.py), never tiled, never with the VAE.

A request's way: `check` (constant work: layout, geometry, limits, output), then `price` (its memory
plan; work that grows with the request only where `needs_shape_work` says so), then `decode` of the
batch it joined. Each carries its RequestContext (engine/request/context.py) from admission.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from vae_service.config import Limits, ServiceConfig
from vae_service.engine.execution.call import DecodeCall, StepGate, decoder_hook
from vae_service.engine.execution.executor import Executor
from vae_service.engine.execution.fallback import FALLBACK_PRECISION, Fp32Fallback
from vae_service.engine.execution.peer_contract import TilePeers
from vae_service.engine.execution.session import DecodeSession, SessionChunk, decode_session_chunks
from vae_service.engine.execution.session_state import SessionState, export_state, restore_walk
from vae_service.engine.media.encoding import ENCODED_OUTPUTS, EncodeSettings, encode_all, fragment_frames
from vae_service.engine.planning.planner import plan_batch, plan_request, retry_plan
from vae_service.engine.planning.tiling import TileGrid, grid_price
from vae_service.engine.pricing.cost_model import CostModel
from vae_service.engine.pricing.encode_cost import EncodePrice
from vae_service.engine.pricing.preview_price import preview_price
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.decode_request import QUALITIES, VIDEO_OUTPUTS, DecodeRequest
from vae_service.engine.request.errors import DecodeFailed, InvalidInput, LimitExceeded, WrongFingerprint
from vae_service.engine.request.latents import PreparedRequest, check_finite, check_output, decoder_latents
from vae_service.engine.request.result import DecodeResult, PendingResult, Timing
from vae_service.engine.request.session import SessionLost, SessionOpen
from vae_service.engine.runtime.preview import build_preview
from vae_service.engine.runtime.runtime import Runtime
from vae_service.engine.runtime.tile_jobs import TileJob
from vae_service.engine.runtime.wan_walk import Walk, post_quant_key
from vae_service.models import LoadedVae
from vae_service.models.probe_cache import ProbeCache
from vae_service.models.spec import jsonable_config, pipeline_statistics
from vae_service.models.wan_internals import SESSION_CLASSES


class DecodeEngine:
    def __init__(self, config: ServiceConfig, loaded: LoadedVae | None = None, probes: ProbeCache | None = None):
        self.runtime = Runtime(config, loaded)
        self.fallback = Fp32Fallback(config, self.runtime)
        self.cost = CostModel(self.runtime, config.fast_path.disable, probes, self.fallback.weight_bytes)
        self.limits: Limits = config.limits  # the live limits of callers without a context (reconfigure)
        self.share_from_pixels = config.parallel.min_output_pixels
        self.encode_settings = EncodeSettings.of(config.encoding)
        self.encode_price = EncodePrice(self.encode_settings)  # its files' price per megapixel, per output
        runtime = self.runtime
        self.preview = build_preview(config, runtime.spec, runtime.scaling, runtime.device, runtime.whole_batch)
        self.cost.price_preview(preview_price(self.preview, self.cost.facts))  # priced like a decode
        self.executor = Executor(runtime, self.preview, self.fallback)
        # every decoder forward checks the running call, and is a step boundary of an image decoder
        # (the walk, which calls the decoder's modules one by one, steps before each latent frame
        # in engine/execution/video.py)
        getattr(runtime.vae, "decoder", runtime.vae).register_forward_pre_hook(decoder_hook(runtime.chunked))

    # ---- what it is --------------------------------------------------------------------------
    @property
    def spec(self):
        return self.runtime.spec

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def video(self) -> bool:
        return self.runtime.video

    @property
    def precision(self) -> str:
        return self.runtime.precision

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.dtype

    @property
    def vae(self) -> torch.nn.Module:
        return self.runtime.vae

    @property
    def fast_path(self):
        return self.runtime.fast_path

    @property
    def fingerprint(self) -> str:
        return self.runtime.fingerprint.digest

    def bind_thread(self) -> None:
        self.runtime.bind_thread()

    def describe(self) -> dict:
        runtime = self.runtime
        return {
            "model": self.spec.name,
            "family": self.spec.family,
            "class": self.spec.class_name,
            "weights": "random (decodes noise)" if self.spec.random_weights else "loaded",
            "latent_channels": self.spec.latent_channels,
            **self.spec.describe(),
            "precision": self.precision,
            "device": str(self.device),
            "cpu_threads": runtime.cpu_threads,
            "fingerprint": runtime.fingerprint.describe(),
            "tiers": sorted({runtime.tier(q) for q in QUALITIES}, key=QUALITIES.index),  # high -> lossless without it
            "preview": self.preview.kind,
            "config": jsonable_config(runtime.vae),
            "statistics": pipeline_statistics(runtime.vae),
            "fast_path": runtime.fast_path.describe(),
            "precision_fallback": self.fallback.describe(),
            # lossless above the bound: whether other replicas can take its decoder's tiles, and why not
            "class_tiles_shared": runtime.replay_unsupported is None,
            "class_tiles_unshared_because": runtime.replay_unsupported,
            "limits": self.limits.model_dump(),
            **self.cost.describe(self.limits),
        }

    # ---- a request's way ---------------------------------------------------------------------
    def context(self, timeout_s: float | None = None) -> RequestContext:
        """A context for an in-process caller (no admission in front)."""
        if timeout_s is None:
            return RequestContext.unbounded(self.limits, self.fingerprint)
        return RequestContext.admit(timeout_s, self.limits, self.fingerprint)

    def check(self, request: DecodeRequest, context: RequestContext | None = None) -> PreparedRequest:
        """Layout, geometry, every limit and the output, in constant work beside the layout change
        (a frame count only a trace can answer is bounded first, then left to `price`). Raises
        InvalidInput (LimitExceeded for a budget); no tensor is moved or cast yet."""
        context = context or self.context()
        limits, cost = context.limits, self.cost
        if request.quality != self.runtime.tier(request.quality):
            request = replace(request, quality=self.runtime.tier(request.quality))
        z, form, timestep = decoder_latents(request, self.spec)
        cost.bound_frames(z, limits)
        if cost.frames_need_trace(z):  # every limit on the frames' lower bound now, exactly in `price`
            cost.check_limits(z, limits, self.spec.geometry.frames.at_least(z.shape[2]))
            return PreparedRequest(request, z, 0, form, timestep, context)
        frames = cost.output_frames(z, limits)
        cost.check_limits(z, limits, frames)
        check_output(request, self.spec, frames, z)
        self.check_encode(request.output, z, frames, limits)
        return PreparedRequest(request, z, frames, form, timestep, context)

    def check_encode(self, output: str, z: torch.Tensor, frames: int, limits: Limits) -> None:
        """The files' encoding price against max_encode_seconds (engine/pricing/encode_cost.py)."""
        pixels = z.shape[0] * frames * z.shape[-2] * z.shape[-1] * self.spec.spatial_scale**2
        self.encode_price.check(output, pixels, limits)

    def needs_shape_work(self, prepared: PreparedRequest) -> bool:
        """Whether `price` runs work that grows with the request (a trace, a per-shape price)."""
        return not prepared.frames or self.cost.needs_shape_work(prepared, prepared.context.limits)

    def price(self, prepared: PreparedRequest) -> PreparedRequest:
        """The memory plan: whole, tiled, or refused (LimitExceeded); then the latents' NaN check."""
        limits, cost = prepared.context.limits, self.cost
        prepared.context.check("pricing")  # it may have waited for the pricing thread
        with prepared.context.bounding("pricing"):  # twin runs and traces for it stop when it ends
            if not prepared.frames:  # a frame count only a trace answers, bounded by check()
                frames = cost.output_frames(prepared.latents, limits)
                cost.check_limits(prepared.latents, limits, frames)
                check_output(prepared.request, self.spec, frames, prepared.latents)
                self.check_encode(prepared.request.output, prepared.latents, frames, limits)
                prepared = replace(prepared, frames=frames)
            tiling = plan_request(prepared, cost, cost.bound(limits), self.share_from_pixels)
        check_finite(prepared.latents)
        return replace(prepared, tiling=tiling)

    def prepare(self, request: DecodeRequest, context: RequestContext | None = None) -> PreparedRequest:
        """check, then price: for in-process callers, who wait for either anyway."""
        return self.price(self.check(request, context))

    def peak_bytes(self, prepared: PreparedRequest) -> int:
        """Estimated peak of decoding this request as planned (whole, or the class's tiled decode;
        a preview is never tiled: its map's or tiny decoder's price)."""
        if prepared.request.quality != "lossless" or prepared.tiling is None:
            return self.cost.peak(prepared)
        return self.cost.class_tiled_peak(prepared)

    def step_price(self, batch: list[PreparedRequest | SessionChunk]) -> tuple[int, int]:
        """(peak, held) of one batch (one batch key) for the scheduler's memory plan: its estimated
        peak, and what it holds between two of its steps while suspended: a video its frames so far,
        the chunk handed over, its latents and its walk's cache; a tile grid all but one tile's
        working set (planning/tiling.py's grid_price); the class's own tiled decode its whole peak
        (its finished tiles wait for the blend); images what a finished run holds until the batch
        ends; a
        session's chunk its answer, latents and the walk's working copy of the session's cache (the
        cache itself is held in the session budget)."""
        cost, runtime = self.cost, self.runtime
        if isinstance(batch[0], SessionChunk):
            h, w = batch[0].prepared.latent_hw
            resident = cost.tiers[batch[0].session.quality].resident(1, h, w)
            held = sum(cost.answer_bytes(c.prepared) + cost.latents_held(c.prepared) + resident for c in batch)
            return self.session_chunk_peak(batch), held
        peak = held = 0
        for prepared in batch:
            own_peak = self.peak_bytes(prepared)
            if isinstance(prepared.tiling, TileGrid):  # between two tiles: all but one tile's working set
                beside = cost.held_while_tiled(prepared)
                own_peak, kept = grid_price(
                    cost.tiers["high"], prepared.items, prepared.frames, prepared.tiling, beside
                )
            elif prepared.tiling is not None:  # the class's own tiled decode: its tiles wait for the blend
                kept = own_peak
            elif runtime.chunked:
                walk = 0
                if runtime.walks is not None and prepared.request.quality != "preview":
                    tier = cost.tiers[runtime.tier(prepared.request.quality)]
                    walk = tier.resident(prepared.items, *prepared.latent_hw)
                kept = cost.held_beside_the_decode(prepared) + cost.latents_held(prepared) + walk
            else:
                kept = cost.held_after_decode(prepared)
            peak, held = peak + own_peak, held + min(kept, own_peak)  # what is held is live at the peak too
        return peak, held

    def decode(
        self,
        batch: list[PreparedRequest],
        abandoned: threading.Event | None = None,
        defer_host_copy: bool = False,
        peers: TilePeers | None = None,
        steps: StepGate | None = None,
    ) -> list[DecodeResult | DecodeFailed | PendingResult | Exception]:
        """Decode requests that share one batch key; results come back in order. A request whose
        output is not finite gets a DecodeFailed in its place, one nobody waits for any more its
        DecodeTimeout; the others are unaffected. Once `abandoned` is set (every caller left), the
        decode stops before its next decoder call (DecodeAbandoned). `defer_host_copy` (CUDA):
        outputs whose copy to the host is still running come back as PendingResults. `peers`: the
        deployment's replicas, which take tiles of tiled requests while they are free
        (engine/execution/tile_executor.py), blended here as if decoded here. Safe to call from several
        threads at once; `steps`: the scheduler's turns, asked at every step boundary (several calls
        then take turns on the device, each suspended between its steps while another runs)."""
        runtime, cost = self.runtime, self.cost
        contexts = [r.context or self.context() for r in batch]
        call = DecodeCall(contexts, self.fingerprint, abandoned, [] if defer_host_copy else None, peers, steps=steps)
        quality = batch[0].request.quality
        start = time.perf_counter()
        scaling = self.preview.scaling if quality == "preview" else runtime.scaling
        latents = [scaling.to_decoder_input(r, runtime.device) for r in batch]
        shared = peers is not None
        plan = plan_batch(batch, cost, cost.bound(contexts[0].limits), shared)
        with torch.inference_mode(), runtime.gate(quality), call.running():
            outputs = self._run_or_out_of_memory(plan, batch, latents, call)
            if outputs is None:  # out of memory: once more in tiles of half the estimated peak
                runtime.release_device_cache()
                plan = retry_plan(batch, cost, shared)
                outputs = self.executor.run(plan, batch, latents, call)
        timing = Timing(0.0, (time.perf_counter() - start) * 1e3, sum(r.items for r in batch), replicas=call.replicas)
        results = [
            o if isinstance(o, Exception) else self._result(o, r, timing, i in call.tiled, call.fell_back.get(i, ()))
            for i, (o, r) in enumerate(zip(outputs, batch, strict=True))
        ]
        if not call.host_copies:
            return results
        copies = tuple(call.host_copies)
        return [r if isinstance(r, Exception) else PendingResult(r, copies) for r in results]

    def _run_or_out_of_memory(self, plan, batch: list[PreparedRequest], latents: list, call: DecodeCall):
        """The plan's outputs, or None when an untiled `high` decode ran out of device memory. The
        retry happens in the caller, after this frame and the exception's traceback are gone:
        inside the handler they would keep the failed attempt's activations alive, and freeing the
        cache would give nothing back."""
        try:
            return self.executor.run(plan, batch, latents, call)
        except torch.OutOfMemoryError:
            if plan.quality != "high" or plan.tiled:
                raise
        return None

    def _result(self, output, prepared: PreparedRequest, timing: Timing, tiled: bool, fell_back) -> DecodeResult:
        """`fell_back`: the items decoded again in fp32; the answer's precision is fp32 when all were."""
        request = prepared.request
        # a streamed answer was handed over as it decoded: nothing left to encode
        encode_as = request.output if request.output in ENCODED_OUTPUTS and not request.stream else None
        precision = FALLBACK_PRECISION if len(fell_back) == prepared.items else self.precision
        return DecodeResult(
            output,
            self.spec.name,
            precision,
            request.quality,
            request.request_id,
            timing,
            encode_as,
            tiled,
            fragments=self.video_fragments(prepared) if request.output in VIDEO_OUTPUTS else (),
            fallback=tuple(fell_back),
        )

    def video_fragments(self, prepared: PreparedRequest) -> tuple[int, ...]:
        """Frames per fragment (a WebM cluster) of this request's mp4 or webm answer, streamed or whole alike."""
        frames = self.spec.geometry.frames
        return fragment_frames(prepared.frames, prepared.latent_frames, frames.law if frames else None)

    # ---- decode sessions (engine/execution/session.py) ------------------------------------------
    def sessions_unsupported_because(self) -> str | None:
        """Why this model cannot decode in sessions (None: it can): a video model whose causal decoder
        the walk knows, with a frame law (a chunk's frame count in constant work)."""
        spec, runtime = self.spec, self.runtime
        if spec.family != "video" or runtime.walks is None or spec.geometry.frames is None:
            why = "decodes images" if spec.family != "video" else "has no causal frame-by-frame decoder the walk knows"
            return (
                f"model '{spec.name}' ({spec.class_name}) {why}; sessions decode {', '.join(SESSION_CLASSES)} "
                "(Wan 2.1 and 2.2): other classes decode whole latents (`stream: true` streams their frames)"
            )
        if spec.geometry.frames.law is None:
            return f"model '{spec.name}' has no frame law: a chunk's frames would need a trace"
        return None

    def open_session(self, session_id: str, settings: SessionOpen, limits: Limits | None = None) -> DecodeSession:
        """A session's state, priced: its walk's history at that size (the tier's `resident` bytes,
        from the meta-device trace). Raises InvalidInput naming the field (LimitExceeded when a chunk
        of it could never fit the bound); the caller holds it in its session budget."""
        limits = limits or self.limits
        if why := self.sessions_unsupported_because():
            raise InvalidInput("model", why)
        if settings.model is not None and settings.model != self.spec.name:
            raise InvalidInput("model", f"unknown model {settings.model!r}; served: ['{self.spec.name}']")
        if settings.output in ENCODED_OUTPUTS and settings.output not in VIDEO_OUTPUTS:
            raise InvalidInput("output", f"a session answers frames or one video, not {settings.output!r}")
        side = self.spec.geometry.min_latent_side
        if min(settings.height, settings.width) < side:
            field = "height" if settings.height < side else "width"
            raise InvalidInput(field, f"model '{self.spec.name}' decodes latents of at least {side}x{side}")
        # the least a session at this size decodes, a chunk of one latent frame past the first, within
        # the deployment's pixels (413 naming the larger side): in Python integers, before anything is
        # priced or a meta tensor is made (the chunk bound's pixels and FLOPs follow, naming `latents`)
        frames = self._chunk_frames(1, 1)
        pixels = frames * settings.height * settings.width * self.spec.spatial_scale**2
        if pixels > limits.max_output_pixels:
            raise LimitExceeded(
                "width" if settings.width > settings.height else "height",
                f"a chunk of one latent frame at {settings.height}x{settings.width} latents decodes to {pixels} "
                f"pixels ({frames} frames), over the limit of {limits.max_output_pixels} (max_output_pixels): "
                "open a smaller session",
            )
        settings = replace(settings, quality=self.runtime.tier(settings.quality))
        if settings.quality == "preview":
            raise InvalidInput("quality", "sessions decode 'lossless' or 'high' (a preview has no causal state)")
        held = self.cost.tiers[settings.quality].resident(1, settings.height, settings.width)
        if self.fallback.enabled:  # it may go on at fp32: the fp32 cache is what it may come to hold
            held = max(held, self.cost.fallback.tiers["lossless"].resident(1, settings.height, settings.width))
        probe = self._chunk_request(settings, limits.max_session_chunk_frames)
        try:
            self.cost.check_limits(probe.latents, limits, self._chunk_frames(1, limits.max_session_chunk_frames))
        except LimitExceeded as exc:  # the chunk bound, not the size: one latent frame fits (above)
            raise LimitExceeded(
                "latents",
                f"a chunk of {limits.max_session_chunk_frames} latent frames (max_session_chunk_frames) at "
                f"{settings.height}x{settings.width} {exc.message.removeprefix('latents: ')}: open a smaller "
                "session or lower limits.max_session_chunk_frames",
            ) from None
        peak = self.cost.peak(probe, settings.quality)
        if peak > self.cost.bound(limits):
            raise LimitExceeded(
                "height",
                f"a chunk of {limits.max_session_chunk_frames} latent frames at {settings.height}x{settings.width} "
                f"would hold about {peak} bytes, over the decode bound of {self.cost.bound(limits)}: open a smaller "
                "session or lower limits.max_session_chunk_frames",
            )
        runtime = self.runtime
        walk = Walk(runtime.vae.decoder, runtime.walks[settings.quality], runtime.fast_path.folded)
        return DecodeSession(session_id, settings, walk, held, self.precision)

    def export_session(self, session: DecodeSession) -> SessionState:
        """The session as plain data on the host, to continue on another replica (session_state.py)."""
        return export_state(session, self.fingerprint)

    def adopt_session(self, state: SessionState, limits: Limits | None = None) -> DecodeSession:
        """A session another replica exported, continued here: priced and checked as an open of its
        settings, its walk restored on this engine's decoder (the fp32 copy's for a session that fell
        back). SessionLost where this engine would decode other bits (another model, precision or
        fast path: a rolling update that changed them), so the client replays instead."""
        if why := self.decodes_otherwise(state.fingerprint):
            raise SessionLost("session", f"its state cannot continue here: {why}; resume in a new session")
        session = self.open_session(state.id, state.settings, limits)
        if state.fallback_from_frame is not None:
            fp32 = self.fallback.session_runtime()
            fresh = Walk(fp32.vae.decoder, fp32.walks["lossless"], fp32.fast_path.folded)
        else:
            fresh = session.walk
        session.walk = restore_walk(state, fresh, self.runtime.device)
        session.latent_frames, session.frames, session.chunks = state.latent_frames, state.frames, state.chunks
        session.precision, session.fallback_from_frame = state.precision, state.fallback_from_frame
        return session

    def _chunk_request(self, settings: SessionOpen, latent_frames: int) -> PreparedRequest:
        """A chunk's shape as a request (for prices): [1, C, t, H, W] at the session's dtype."""
        shape = (1, self.spec.latent_channels, latent_frames, settings.height, settings.width)
        z = torch.empty(shape, dtype=settings.torch_dtype, device="meta")
        request = DecodeRequest(z, quality=settings.quality, output=settings.output)
        return PreparedRequest(request, z, self._chunk_frames(1, latent_frames))

    def _chunk_frames(self, first_latent: int, latent_frames: int) -> int:
        """Output frames of latent frames first_latent..first_latent+latent_frames-1 of a clip (0-based)."""
        a, b = self.spec.geometry.frames.law
        before = 0 if first_latent == 0 else a * first_latent + b
        return a * (first_latent + latent_frames) + b - before

    def check_chunk(self, session: DecodeSession, request: DecodeRequest, context: RequestContext) -> SessionChunk:
        """A chunk of `session` ([1, C, t, H, W], its next latent frames), checked in constant work
        beside the layout change: layout, the session's size, the chunk bound, pixels and FLOPs, the
        chunk's price, NaN/Inf. Raises InvalidInput naming the field; the session is untouched."""
        settings, limits = session.settings, context.limits
        if request.latents.dim() != 5 or request.latents.shape[0] != 1:  # an image's [1, C, H, W] too: a lost axis
            raise InvalidInput("latents", f"a session's chunk is [1, C, t, H, W], got {list(request.latents.shape)}")
        z, form, timestep = decoder_latents(request, self.spec)
        if tuple(z.shape[-2:]) != (settings.height, settings.width):
            field = "height" if z.shape[-2] != settings.height else "width"
            raise InvalidInput(
                field, f"the session decodes {settings.height}x{settings.width} latents, got {list(z.shape[-2:])}"
            )
        if z.dtype != settings.torch_dtype:
            raise InvalidInput("dtype", f"the session was opened for {settings.dtype} chunks, got {z.dtype}")
        t = z.shape[2]
        if t > limits.max_session_chunk_frames:
            raise LimitExceeded(
                "latents",
                f"a chunk of {t} latent frames is over the limit of {limits.max_session_chunk_frames} "
                "(max_session_chunk_frames)",
            )
        frames = self._chunk_frames(session.latent_frames, t)
        self.cost.check_limits(z, limits, frames)
        check_finite(z)
        chunk_request = replace(request, quality=settings.quality, output=settings.output)
        prepared = PreparedRequest(chunk_request, z, frames, form, timestep, context)
        place = post_quant_key(settings.clip_latent_frames, session.walk.steps, t, z.shape[3] * z.shape[4], self.device)
        return SessionChunk(session, prepared, session.frames, place)

    def session_chunk_peak(self, chunks: list[SessionChunk]) -> int:
        """Estimated peak of decoding these chunks in one batch (engine/execution/session.py): `high`
        stacked, its batch's tier price with every session's history copied out after it (`split`);
        `lossless` one at a time, the largest chunk's price beside the answers of the others. Each
        chunk also holds its latents' normalisation temporary and post-quant output; a session that
        may fall back, the fp32 decode of its chunk instead."""
        cost, first = self.cost, chunks[0]
        quality, n = first.session.quality, len(chunks)
        extra = [2 * cost.latent_bytes(c.prepared) + cost.latents_held(c.prepared) for c in chunks]
        if quality == "high" and n > 1:
            stacked = replace(
                first.prepared, latents=first.prepared.latents.expand(n, *first.prepared.latents.shape[1:])
            )
            h, w = first.prepared.latent_hw
            price = cost.peak(stacked, quality) + n * cost.tiers[quality].resident(1, h, w) + sum(extra)
        else:
            peaks = [cost.peak(c.prepared, quality) + e for c, e in zip(chunks, extra, strict=True)]
            kept = [cost.answer_bytes(c.prepared) + cost.latents_held(c.prepared) for c in chunks]
            price = max(p + sum(kept) - k for p, k in zip(peaks, kept, strict=True))
        if self.fallback.enabled:
            fp32 = max(cost.fallback_peak(c.prepared, False) + e for c, e in zip(chunks, extra, strict=True))
            price = max(price, fp32 + sum(cost.answer_bytes(c.prepared) for c in chunks))
        return price

    def decode_session_chunks(
        self, chunks: list[SessionChunk], abandoned: threading.Event | None = None, steps: StepGate | None = None
    ) -> list:
        """One batch of session chunks (one batch key), on a device thread: a ChunkFrames per chunk,
        or its error (DecodeFailed, the timeout of one nobody waits for) in its place."""
        call = DecodeCall([c.context for c in chunks], self.fingerprint, abandoned, steps=steps)
        with torch.inference_mode(), self.runtime.gate(chunks[0].session.quality), call.running():
            return decode_session_chunks(self.runtime, chunks, call, self.fallback)

    # ---- tiles of other replicas' requests -----------------------------------------------
    def decodes_otherwise(self, fingerprint: str) -> str | None:
        """Why this engine would give other bits than the one of `fingerprint`; None if it would not."""
        if fingerprint == self.fingerprint:
            return None
        return f"this replica decodes as {self.fingerprint}, the request's replica as {fingerprint}"

    def run_tile(self, job: TileJob, fingerprint: str) -> Iterator[torch.Tensor]:
        """A tile of another replica's request (engine/runtime/tile_jobs.py): its output chunk by chunk, as
        that replica's own plan would decode it here. OfferRefused (WrongFingerprint) where this engine
        would decode other bits. Run it and close it on one thread: the job's tier and inference
        mode hold on it throughout, and only that thread may restore them."""
        if why := self.decodes_otherwise(fingerprint):
            raise WrongFingerprint("fingerprint", why)
        runtime = self.runtime
        with torch.inference_mode(), runtime.gate(runtime.job_tier(job)):
            yield from runtime.run_job(job)

    # ---- answers and lifecycle -------------------------------------------------------------
    def encode(self, result: DecodeResult) -> DecodeResult:
        """Encode a result's pixels here, item after item (in-process callers; the service encodes
        in a pool, off the device thread)."""
        if result.encode_as is None:
            return result
        start = time.perf_counter()
        files = encode_all(result.output.numpy(), result.encode_as, self.encode_settings, result.fragments)
        timing = replace(result.timing, encode_ms=(time.perf_counter() - start) * 1e3)
        return replace(result, output=files, encode_as=None, timing=timing)

    def release_folded(self) -> int:
        """The fast path's folded weights and the fp32 fallback's weights (both made again when
        needed); bytes freed."""
        return self.runtime.release_folded() + self.fallback.release()

    def check_device(self) -> None:
        self.runtime.check_device()
