"""Every diffusers internal the service reads about a class's own tiled decode (`enable_tiling()`,
then `decode`), in one place: the spatial tile grid it cuts the latents into, and where it tiles time
as well. The cost model prices a `lossless` decode above the memory bound from this grid (its few
distinct tile shapes and its blend buffers, engine/pricing/class_tiled_price.py) instead of running it.

Three ways the classes of diffusers 0.35-0.42 keep their tile settings (attributes set by
`__init__` and `enable_tiling`):
- `tile_latent_min_size` and `tile_overlap_factor` (AutoencoderKL, AutoencoderKLFlux2,
  AutoencoderKLKVAE, AutoencoderKLHunyuanImage): tiles of that size every
  `int(size * (1 - factor))` latent pixels;
- `tile_sample_min_height/width`, `tile_sample_stride_height/width` and `spatial_compression_ratio`
  (Wan, Qwen-Image, HunyuanVideo, LTX, Mochi, SANA's DC, Magvit): tiles of `min // ratio` every
  `stride // ratio` latent pixels;
- `tile_latent_min_height/width` with `tile_overlap_factor_height/width` (CogVideoX) or one
  `tile_overlap_factor` (HunyuanVideo 1.5).
In all of them the tiles start at 0, stride, 2 * stride, ... up to the latent's size (the last ones
cut short by the border), and the decode tiles only when a side is over the tile size.

Classes that also tile time (`use_framewise_decoding` with `tile_sample_min_num_frames` and
`temporal_compression_ratio`: HunyuanVideo, LTX) do so past `temporal_limit` latent frames.

What a tiled decode holds is decided by its grid: how many tiles per side and how large each is.
`priced_at` gives the shape a price per shape is measured at for all shapes near it: as many tiles
per side, the last one rounded up to the grid's overlap (every tile and the output at least as
large: a price that bounds theirs).

A grid read wrongly would misprice, never misdecode: the cost model checks the grid against the
decoder calls of a real tiled decode on the meta twin at start-up and prices per shape where they
disagree. pyproject.toml bounds diffusers to the releases these were read from.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class AxisTiles:
    tile: int  # latent pixels
    stride: int

    def spans(self, size: int) -> list[int]:
        """The tiles' lengths along an axis of `size` latent pixels, in order."""
        return [min(self.tile, size - start) for start in range(0, size, self.stride)]

    @property
    def step(self) -> int:
        """What `priced_at` rounds a side up to: the tiles' overlap (the stride where none)."""
        return self.tile - self.stride if self.tile > self.stride else self.stride

    def priced_at(self, size: int, whole: bool) -> int:
        """`size` rounded up to a multiple of `step`, within as many tiles (`whole`: the class
        decodes these latents untiled; they stay within one tile)."""
        most = self.tile if whole else -(-size // self.stride) * self.stride
        return max(size, min(-(-size // self.step) * self.step, most))


@dataclass(frozen=True)
class ClassGrid:
    height: AxisTiles
    width: AxisTiles
    temporal_limit: int | None = None  # latent frames past which the class tiles time too

    def tiles(self, h: int, w: int) -> list[tuple[int, int]] | None:
        """Each tile's (h, w) in the order the class decodes them (rows, then columns); None where
        the class decodes these latents whole."""
        if h <= self.height.tile and w <= self.width.tile:
            return None
        return [(th, tw) for th in self.height.spans(h) for tw in self.width.spans(w)]

    def priced_at(self, h: int, w: int) -> tuple[int, int]:
        """The largest latents near (h, w) that the class decodes the same way (untiled, or with as
        many tiles per side), each side rounded up to its overlap: every tile of theirs is at least
        as large as (h, w)'s, so what their decode holds bounds what (h, w)'s does, and every shape
        that rounds to them shares one price."""
        whole = self.tiles(h, w) is None
        return self.height.priced_at(h, whole), self.width.priced_at(w, whole)

    def tiles_time(self, latent_frames: int) -> bool:
        return self.temporal_limit is not None and latent_frames > self.temporal_limit


def _int(value) -> int | None:
    return int(value) if isinstance(value, int | float) and value > 0 else None


def _axes(view: nn.Module) -> tuple[AxisTiles, AxisTiles] | None:
    size, factor = _int(getattr(view, "tile_latent_min_size", None)), getattr(view, "tile_overlap_factor", None)
    if size is not None and isinstance(factor, float):
        axis = AxisTiles(size, int(size * (1 - factor)))
        return axis, axis
    ratio = _int(getattr(view, "spatial_compression_ratio", None))
    sample = [_int(getattr(view, f"tile_sample_{k}", None)) for k in ("min_height", "min_width")]
    strides = [_int(getattr(view, f"tile_sample_stride_{k}", None)) for k in ("height", "width")]
    if ratio is not None and None not in sample and None not in strides:
        return AxisTiles(sample[0] // ratio, strides[0] // ratio), AxisTiles(sample[1] // ratio, strides[1] // ratio)
    latent = [_int(getattr(view, f"tile_latent_min_{k}", None)) for k in ("height", "width")]
    factors = [getattr(view, f"tile_overlap_factor_{k}", factor) for k in ("height", "width")]
    if None not in latent and all(isinstance(f, float) for f in factors):
        return tuple(AxisTiles(t, int(t * (1 - f))) for t, f in zip(latent, factors, strict=True))
    return None


def class_grid(view: nn.Module) -> ClassGrid | None:
    """The grid of `view`'s tiled decode (a model with tiling switched on), None where its settings
    are not in one of the known forms."""
    axes = _axes(view)
    if axes is None or min(axes[0].stride, axes[1].stride) < 1:
        return None
    temporal = None
    if getattr(view, "use_framewise_decoding", False):
        frames = _int(getattr(view, "tile_sample_min_num_frames", None))
        ratio = _int(getattr(view, "temporal_compression_ratio", None))
        if frames is not None and ratio is not None:
            temporal = frames // ratio
    return ClassGrid(*axes, temporal)
