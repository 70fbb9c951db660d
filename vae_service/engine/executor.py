"""Runs a batch plan (engine/planner.py) with the runtime's primitives, in the call's own state
(engine/call.py): one output per request, in order. Every run checks its requests' contexts: a
request nobody waits for any more is answered with its timeout or abandonment, the others go on.

Images: untiled runs decode through `vae.decode` (high: the batch together) or the class's decode of
each item alone (lossless); tiled runs blend spatial tiles (engine/tiling.py), decoded here one at a
time or by other replicas (the call's spreader); `ClassTiles` runs the class's own tiled decode on a
view (models/diffusers_tiling.py). Video (and any video-latent decoder) goes chunk by chunk
through engine/video.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vae_service.engine.call import DecodeCall
from vae_service.engine.errors import DecodeAbandoned, DecodeFailed, DecodeTimeout
from vae_service.engine.latents import PreparedRequest
from vae_service.engine.planner import BatchPlan, ClassTiles, Run
from vae_service.engine.postprocess import postprocess
from vae_service.engine.preview import Preview, frame_counts
from vae_service.engine.runtime import Runtime
from vae_service.engine.tiling import OnDevice, TileGrid, tiled_chunks, tiled_image
from vae_service.engine.video import NON_FINITE, decode_video
from vae_service.models.decoder_shapes import DecoderShapes
from vae_service.models.diffusers_tiling import tiled_decode_elsewhere, tiled_view


class LocalTiles:
    """Tiles decoded here, one at a time as the blend reads them."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def images(self, tiles: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        return map(self.runtime.image, tiles)

    def chunks(self, quality: str, timestep: float | None):
        decoder = self.runtime.chunks(quality, timestep)

        def lazy(tile: torch.Tensor) -> Iterator[torch.Tensor]:
            yield from decoder(tile)  # started when first read: tile after tile holds one tile at a time

        return lazy


class Executor:
    def __init__(self, runtime: Runtime, preview: Preview):
        self.runtime, self.preview = runtime, preview
        self.local = LocalTiles(runtime)
        self._decoder_shapes: DecoderShapes | None = None  # the replay's meta answers, kept for this model

    def run(
        self, plan: BatchPlan, batch: list[PreparedRequest], latents: list[torch.Tensor], call: DecodeCall
    ) -> list[torch.Tensor | DecodeFailed | DecodeTimeout | None]:
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
                decoded = self._run(plan.quality, run, members, batch, latents, call)
            except (DecodeAbandoned, DecodeTimeout) as stopped:
                if not (isinstance(stopped, DecodeAbandoned) or all(call.gone(i) for i in members)):
                    raise
                decoded = [call.ended_error(i) for i in members]
            for i, output in zip(members, decoded, strict=True):
                outputs[i] = output
        return outputs

    def _run(self, quality: str, run: Run, members: list[int], batch, latents, call: DecodeCall) -> list:
        requests, zs = [batch[i] for i in members], [latents[i] for i in members]
        if self.runtime.chunked:
            return self._video(quality, run, members, requests, zs, call)
        pixels = self._images(quality, run, members, requests, zs, call)
        return [self._finish(d, r, call) for d, r in zip(pixels, requests, strict=True)]

    # ---- images ------------------------------------------------------------------------------
    def _images(
        self, quality: str, run: Run, members: list[int], requests: list[PreparedRequest], latents, call: DecodeCall
    ) -> list[torch.Tensor]:
        runtime, sizes = self.runtime, [z.shape[0] for z in latents]
        if quality == "preview":
            return list(self.preview.image(torch.cat(latents)).split(sizes))
        if isinstance(run.tiling, ClassTiles):  # lossless above the bound, item by item
            return [
                self._class_tiled(z, r.timestep, call, i) for z, r, i in zip(latents, requests, members, strict=True)
            ]
        if not run.together:  # lossless: every item alone
            return [runtime.each_alone(runtime.vae, z, r.timestep) for z, r in zip(latents, requests, strict=True)]
        if isinstance(run.tiling, TileGrid):
            (z,), (i,) = latents, members
            return [tiled_image(z, run.tiling, runtime.spec.spatial_scale, self._tile_images(quality, call, i))]
        return list(runtime.image(torch.cat(latents)).split(sizes))

    def _tile_images(self, quality: str, call: DecodeCall, i: int):
        """Tiles decoded here one by one, or by the call's spreader (other replicas: their pixels
        come back as sent, and are blended here on this device)."""
        if call.spread is None:
            return self.local.images
        spread, local = call.spread, self.local.images

        def elsewhere(tiles: list[torch.Tensor]) -> Iterator[torch.Tensor]:
            return self._here(spread.images(tiles, quality, call.tile_call(i), local))

        return elsewhere

    def _here(self, outputs: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        device = self.runtime.device
        return (out.to(device) for out in outputs)  # one at a time on the device, as blended

    def _class_tiled(self, z: torch.Tensor, timestep: float | None, call: DecodeCall, i: int) -> torch.Tensor:
        """The class's own tiled decode of each item; with a spreader, its decoder's tiles are
        decoded by other replicas (models/diffusers_tiling.py: still the same bits)."""
        runtime = self.runtime
        view = tiled_view(runtime.vae)
        if call.spread is None or timestep is not None:
            return runtime.each_alone(view, z, timestep)
        spread, tile_call = call.spread, call.tile_call(i)

        def decode_tiles(tiles: list[torch.Tensor], part: str):
            return self._here(spread.images(tiles, part, tile_call, _DecoderParts(runtime, part)))

        if self._decoder_shapes is None:
            self._decoder_shapes = DecoderShapes.of(view)
        decoded = []
        for item in z.split(1):
            pixels = tiled_decode_elsewhere(view, item, decode_tiles, call.checkpoint, self._decoder_shapes)
            decoded.append(runtime.pixels(view, item) if pixels is None else pixels)
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded)

    def _finish(self, decoded: torch.Tensor, prepared: PreparedRequest, call: DecodeCall):
        if not bool(torch.isfinite(decoded).all()):
            return DecodeFailed("latents", NON_FINITE)
        return postprocess(decoded, prepared.request.output, call.host_copies, self.runtime.spec.entry.pixels)

    # ---- video -------------------------------------------------------------------------------
    def _video(
        self, quality: str, run: Run, members: list[int], requests: list[PreparedRequest], latents, call: DecodeCall
    ) -> list:
        runtime, first = self.runtime, requests[0]
        if quality == "preview":
            law = runtime.spec.geometry.frames.law if runtime.spec.geometry.frames else None
            chunks = _PreviewChunks(self.preview, frame_counts(first.frames, first.latent_frames, law))
        elif isinstance(run.tiling, ClassTiles):  # the whole clip at once, at the end
            chunks = _ClassTiledChunks(self, first.timestep, call, members[0])
        elif isinstance(run.tiling, TileGrid):
            chunks = _TiledChunks(self, quality, first.timestep, run.tiling, call, members[0])
        else:
            chunks = runtime.chunks(quality, first.timestep)
        outputs = decode_video(requests, latents, run.together, chunks, call, runtime.spec.entry.pixels)
        return outputs if runtime.video else [_one_frame(o) for o in outputs]

    def tile_runs(self, quality: str, timestep: float | None, call: DecodeCall, i: int):
        """Video tiles: every tile's chunks, decoded here (lazily, as read) or by the call's spreader."""
        lazy = self.local.chunks(quality, timestep)
        if call.spread is None:
            return lambda tiles: [lazy(tile) for tile in tiles]
        spread, device, tile_call = call.spread, self.runtime.device, call.tile_call(i)

        def elsewhere(tiles: list[torch.Tensor]):
            return [OnDevice(run, device) for run in spread.chunks(tiles, quality, timestep, tile_call, lazy)]

        return elsewhere


class _DecoderParts:
    """A replayed tiled decode's job decoded here (a replica refused it)."""

    def __init__(self, runtime: Runtime, part: str):
        self.runtime, self.part = runtime, part

    def __call__(self, tiles: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        from vae_service.models.diffusers_tiling import decoder_part

        return (decoder_part(self.runtime.vae, tile, self.part) for tile in tiles)


class _PreviewChunks:
    def __init__(self, preview: Preview, counts: list[int]):
        self.preview, self.counts = preview, counts

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        return self.preview.chunks(z, self.counts)


class _ClassTiledChunks:
    def __init__(self, executor: Executor, timestep: float | None, call: DecodeCall, i: int):
        self.executor, self.timestep, self.call, self.i = executor, timestep, call, i

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        return iter([self.executor._class_tiled(z, self.timestep, self.call, self.i)])


class _TiledChunks:
    def __init__(self, executor: Executor, quality, timestep, grid: TileGrid, call: DecodeCall, i: int):
        self.runs = executor.tile_runs(quality, timestep, call, i)
        self.grid, self.scale = grid, executor.runtime.spec.spatial_scale

    def __call__(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        return tiled_chunks(z, self.grid, self.scale, self.runs)


def _one_frame(output):
    """An image model with a video decoder (Qwen-Image): its one frame as an image, uint8
    [B, 1, H, W, 3] -> [B, H, W, 3], float [B, 3, 1, H, W] -> [B, 3, H, W]."""
    if not isinstance(output, torch.Tensor):
        return output
    return output.squeeze(1) if output.dtype == torch.uint8 else output.squeeze(2)
