"""Runs a batch plan (engine/planning/planner.py) with the runtime's primitives, in the call's own state
(engine/execution/call.py): one output per request, in order. Every run checks its requests' contexts: a
request nobody waits for any more is answered with its timeout or abandonment, the others go on.

Images: untiled runs decode through `vae.decode` (high: the batch together) or the class's decode of
each item alone (lossless). Tiled runs hand their tiles as jobs (engine/runtime/tile_jobs.py) to the run's
tile executor (engine/execution/tile_executor.py: here, or shared with the deployment's replicas, as the plan
says) and blend what it yields (engine/planning/tiling.py's `blended`, the one place tiles are blended);
`ClassTiles` runs the class's own tiled decode on a view, its decoder's calls made by the same
executors where they are shared (models/diffusers_tiling.py replays it bit for bit). Video (and any
video-latent decoder) goes chunk by chunk through engine/execution/video.py, a tiled run's chunks blended the
same way.

A tile that failed elsewhere (lost twice: 503; a replica's bug: 500) fails its request alone, as its
result: the batch goes on, and the scheduler does not run the request again.

fp16/bf16 items whose output is not finite are decoded again in fp32 (engine/execution/fallback.py)
by the plan's fallback for their request (`BatchPlan.fallbacks`: whole, or the class's own tiled
decode, as the fp32 deployment with the same bound decodes them), and the answer says `tiled` when
any of its pixels came from tiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, closing

import torch

from vae_service.engine.execution.call import DecodeCall
from vae_service.engine.execution.fallback import Fp32Fallback, tiled_after_fallback
from vae_service.engine.execution.tile_executor import LocalTiles, NotShared, SharedTiles, TileBug, TileExecutor
from vae_service.engine.execution.video import NON_FINITE, decode_video
from vae_service.engine.media.frames import frame_counts
from vae_service.engine.media.postprocess import postprocess
from vae_service.engine.planning.planner import BatchPlan, ClassTiles, Run
from vae_service.engine.planning.tiling import TileGrid, blended, tier_tiles
from vae_service.engine.request.errors import DecodeAbandoned, DecodeFailed, DecodeTimeout, Unavailable
from vae_service.engine.request.latents import PreparedRequest
from vae_service.engine.runtime.preview import Preview
from vae_service.engine.runtime.runtime import Runtime
from vae_service.engine.runtime.tile_jobs import CausalTile, DecoderInput
from vae_service.models.decoder_shapes import DecoderShapes
from vae_service.models.diffusers_tiling import tiled_decode_elsewhere, tiled_view

TILE_FAILURES = (Unavailable, TileBug)  # a request's own: answered as its result


class Executor:
    def __init__(self, runtime: Runtime, preview: Preview, fallback: Fp32Fallback):
        self.runtime, self.preview, self.fallback = runtime, preview, fallback
        self.local = LocalTiles(runtime)
        self._decoder_shapes: DecoderShapes | None = None  # the replay's meta answers, kept for this model

    def run(
        self, plan: BatchPlan, batch: list[PreparedRequest], latents: list[torch.Tensor], call: DecodeCall
    ) -> list[torch.Tensor | DecodeFailed | DecodeTimeout | Exception | None]:
        """Every run of the plan, in order: one output per request (None once streamed)."""
        outputs: list = [None] * len(batch)
        for run in plan.runs:
            members = [i for i in run.members if not call.gone(i)]
            for i in set(run.members) - set(members):
                outputs[i] = call.ended_error(i)
            if not members:
                continue
            call.running_members = tuple(members)
            try:
                decoded = self._run(plan, run, members, batch, latents, call)
            except (DecodeAbandoned, DecodeTimeout) as stopped:
                if not (isinstance(stopped, DecodeAbandoned) or all(call.gone(i) for i in members)):
                    raise
                decoded = [call.ended_error(i) for i in members]
            except TILE_FAILURES as failed:
                decoded = [failed] * len(members)
            for i, output in zip(members, decoded, strict=True):
                outputs[i] = output
        return outputs

    def tiles(self, run: Run, call: DecodeCall, i: int) -> TileExecutor:
        """The run's tile executor, as the plan says: shared with the deployment's replicas, or here."""
        if run.shared and call.peers is not None:
            return SharedTiles(self.local, call.peers, call.tile_call(i))
        return self.local

    def _run(self, plan: BatchPlan, run: Run, members: list[int], batch, latents, call: DecodeCall) -> list:
        quality, requests, zs = plan.quality, [batch[i] for i in members], [latents[i] for i in members]
        if self.runtime.chunked:
            return self._video(plan, run, members, requests, zs, call)
        pixels = self._images(quality, run, members, requests, zs, call)
        fallback = self._fallback_for(quality)
        return [
            self._finish(pixels, n, r, call, i, None if fallback is None else plan.fallback_tiled(i))
            for n, (r, i) in enumerate(zip(requests, members, strict=True))
        ]

    def _fallback_for(self, quality: str) -> Fp32Fallback | None:
        """What answers this tier's items that overflow: the fp32 fallback (by the plan's fallback
        for their request), or None (they fail). `preview` is approximate by contract and never
        falls back."""
        return self.fallback if self.fallback.enabled and quality != "preview" else None

    # ---- images ------------------------------------------------------------------------------
    def _images(
        self, quality: str, run: Run, members: list[int], requests: list[PreparedRequest], latents, call: DecodeCall
    ) -> list[torch.Tensor]:
        runtime, sizes = self.runtime, [z.shape[0] for z in latents]
        if quality == "preview":
            return list(self.preview.image(torch.cat(latents)).split(sizes))
        if isinstance(run.tiling, ClassTiles):  # lossless above the bound, item by item
            return [
                self._class_tiled(z, r.timestep, run, call, i)
                for z, r, i in zip(latents, requests, members, strict=True)
            ]
        if not run.together:  # lossless: every item alone
            return [runtime.each_alone(runtime.vae, z, r.timestep) for z, r in zip(latents, requests, strict=True)]
        if isinstance(run.tiling, TileGrid):
            (z,), (i,) = latents, members
            grid = run.tiling
            jobs = tier_tiles(z, grid, quality, None)
            outputs = self.tiles(run, call, i).run(jobs, optional=grid.optional, window=grid.ahead + 1)
            try:
                (image,) = blended(grid, runtime.spec.spatial_scale, outputs)
            except NotShared:  # fits whole, and no replica is free to share it with
                return [runtime.image(z)]
            call.tiled.add(i)
            return [image]
        return list(runtime.image(torch.cat(latents)).split(sizes))

    def _class_tiled(self, z: torch.Tensor, timestep: float | None, run: Run, call: DecodeCall, i: int) -> torch.Tensor:
        """The class's own tiled decode of each item; where the run's tiles are shared, or the call
        takes turns with other decodes (a scheduler's steps), its decoder's calls go to the tile
        executor as jobs (models/diffusers_tiling.py: still the same bits), each tile a step (a
        video-latent decoder's own tiled decode keeps state on the model within a tile)."""
        runtime = self.runtime
        view = tiled_view(runtime.vae)
        call.tiled.add(i)
        jobs_wanted = (run.shared and call.peers is not None) or call.steps is not None
        if not jobs_wanted or timestep is not None or runtime.replay_unsupported:
            return runtime.each_alone(view, z, timestep)
        tiles = self.tiles(run, call, i)
        if self._decoder_shapes is None:
            self._decoder_shapes = DecoderShapes.of(view)
        decoded = []
        with ExitStack() as opened:

            def decode_jobs(inputs: list[torch.Tensor], causal: bool) -> Iterator[torch.Tensor]:
                jobs = [CausalTile(x) if causal else DecoderInput(x) for x in inputs]
                outputs = opened.enter_context(closing(tiles.run(jobs)))  # closed (cancelled) however it ends
                return (out.pixels for out in outputs)

            for item in z.split(1):
                pixels = tiled_decode_elsewhere(view, item, decode_jobs, call.checkpoint, self._decoder_shapes)
                decoded.append(runtime.pixels(view, item) if pixels is None else pixels)
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded)

    def _finish(self, pixels: list, n: int, prepared: PreparedRequest, call: DecodeCall, i: int, fallback: bool | None):
        """pixels[n], `prepared`'s decoded output, as its answer (taken from the list: nothing else
        holds it). `fallback`: None where overflowed items fail, else whether their fp32 plan is
        the class's own tiled decode."""
        finite = bool(torch.isfinite(pixels[n]).all())
        if not finite and (fallback is None or not self._fall_back(pixels, n, prepared, call, i, fallback)):
            return DecodeFailed("latents", NON_FINITE)
        decoded, pixels[n] = pixels[n], None
        return postprocess(decoded, prepared.request.output, call.host_copies, self.runtime.spec.entry.pixels)

    def _fall_back(
        self, pixels: list, n: int, prepared: PreparedRequest, call: DecodeCall, i: int, tiled: bool
    ) -> bool:
        """pixels[n] with its overflowed items decoded again by the fallback's plan (fallback.py);
        False when not even fp32 gives finite pixels."""
        held, pixels[n] = [pixels[n]], None  # the only reference: the fallback drops it before decoding
        again, pixels[n] = self.fallback.images(held, prepared, tiled)
        if pixels[n] is None:
            return False
        call.fell_back[i] = again
        tiled_after_fallback(call, i, prepared, again, tiled)
        return True

    # ---- video -------------------------------------------------------------------------------
    def _video(
        self, plan: BatchPlan, run: Run, members: list[int], requests: list[PreparedRequest], latents, call: DecodeCall
    ) -> list:
        runtime, first, quality = self.runtime, requests[0], plan.quality
        if quality == "preview":
            law = runtime.spec.geometry.frames.law if runtime.spec.geometry.frames else None
            chunks = _PreviewChunks(self.preview, frame_counts(first.frames, first.latent_frames, law))
        elif isinstance(run.tiling, ClassTiles):  # the whole clip at once, at the end
            chunks = _ClassTiledChunks(self, first.timestep, run, call, members[0])
        elif isinstance(run.tiling, TileGrid):
            chunks = _TiledChunks(self, quality, first.timestep, run, call, members[0])
        else:
            chunks = runtime.chunks(quality, first.timestep)
        fallback = self._fallback_for(quality)
        tiled = {i for i in members if plan.fallback_tiled(i)}  # their fp32 plan: the class's tiled decode
        outputs = decode_video(
            requests, latents, run.together, chunks, call, members, fallback, runtime.spec.entry.pixels, tiled
        )
        for i, prepared in zip(members, requests, strict=True):
            if i in call.fell_back:
                tiled_after_fallback(call, i, prepared, call.fell_back[i], i in tiled)
        return outputs if runtime.video else [_one_frame(o) for o in outputs]


class _PreviewChunks:
    def __init__(self, preview: Preview, counts: list[int]):
        self.preview, self.counts = preview, counts

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        return self.preview.chunks(z, self.counts)


class _ClassTiledChunks:
    def __init__(self, executor: Executor, timestep: float | None, run: Run, call: DecodeCall, i: int):
        self.executor, self.timestep, self.run, self.call, self.i = executor, timestep, run, call, i

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        return iter([self.executor._class_tiled(z, self.timestep, self.run, self.call, self.i)])


class _TiledChunks:
    """A tiled run's blended chunks; an optional grid no replica shares decodes whole instead."""

    def __init__(self, executor: Executor, quality: str, timestep: float | None, run: Run, call: DecodeCall, i: int):
        self.executor, self.quality, self.timestep, self.run, self.call, self.i = (
            executor, quality, timestep, run, call, i
        )  # fmt: skip

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        runtime, grid = self.executor.runtime, self.run.tiling
        jobs = tier_tiles(z, grid, self.quality, self.timestep)
        outputs = self.executor.tiles(self.run, self.call, self.i).run(jobs, grid.lockstep, grid.optional)
        chunks = blended(grid, runtime.spec.spatial_scale, outputs, grid.lockstep)
        try:
            first = next(chunks, None)
        except NotShared:
            yield from runtime.chunks(self.quality, self.timestep)(z)
            return
        self.call.tiled.add(self.i)
        if first is not None:
            yield first
            yield from chunks


def _one_frame(output):
    """An image model with a video decoder (Qwen-Image): its one frame as an image, uint8
    [B, 1, H, W, 3] -> [B, H, W, 3], float [B, 3, 1, H, W] -> [B, 3, H, W]."""
    if not isinstance(output, torch.Tensor):
        return output
    return output.squeeze(1) if output.dtype == torch.uint8 else output.squeeze(2)
