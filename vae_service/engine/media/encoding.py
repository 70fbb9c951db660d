"""Encoding decoded pixels as files (PNG, JPEG, MP4), one batch item at a time, so that a pool can
encode the items of a request in parallel while the device decodes the next batch. Measured here
with PIL on one 1024x1024 image: PNG 22-111 ms at the default level 6 (content-dependent), JPEG
q95 2-7 ms; PNG level 1 (our default) writes ~10-30% larger files several times faster.

MP4 is fragmented (engine/media/fmp4.py): an init segment, then one fragment per latent frame's worth of
frames, each starting with a keyframe (`fragment_frames`). A streamed answer writes the same
fragments as its frames decode (serving/mp4_stream.py), so a whole answer and a stream of the same
frames are the same bytes."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vae_service.engine.media.fmp4 import FragmentedMp4
from vae_service.engine.media.frames import frame_counts
from vae_service.engine.request.decode_request import IMAGE_OUTPUTS, VIDEO_OUTPUTS

ENCODED_OUTPUTS = IMAGE_OUTPUTS + VIDEO_OUTPUTS


@dataclass(frozen=True)
class EncodeSettings:
    png_compress_level: int = 1
    jpeg_quality: int = 95
    webp_quality: int = 90
    webp_lossless: bool = False
    webp_method: int = 0
    avif_quality: int = 75
    avif_speed: int = 8
    mp4_fps: int = 16  # webm's too
    mp4_crf: int = 23
    mp4_bitrate: int | None = None  # bits/s; replaces the crf when set
    mp4_preset: str = "veryfast"
    webm_crf: int = 32
    webm_bitrate: int | None = None  # bits/s; replaces the crf when set
    webm_speed: int = 8

    @classmethod
    def of(cls, encoding) -> EncodeSettings:
        """The settings of a deployment's `encoding` config (config.EncodingConfig)."""
        return cls(**{name: getattr(encoding, name) for name in cls.__dataclass_fields__})


def fragment_frames(total: int, latent_frames: int, law: tuple[int, int] | None) -> tuple[int, ...]:
    """Frames per mp4 fragment: one latent frame's worth each (the decoder's own law, as the stream
    hands them over), so a player can start on the first latent frame's frames."""
    counts = frame_counts(total, latent_frames, law)
    if sum(counts) != total or min(counts) < 1:  # a decoder off its law: the frames spread evenly
        counts = frame_counts(total, latent_frames, None)
    return tuple(n for n in counts if n > 0)


def mp4_writer(width: int, height: int, settings: EncodeSettings) -> FragmentedMp4:
    crf = None if settings.mp4_bitrate is not None else settings.mp4_crf
    return FragmentedMp4(width, height, settings.mp4_fps, crf, settings.mp4_bitrate, settings.mp4_preset)


def items(pixels: np.ndarray, output: str) -> list[np.ndarray]:
    """uint8 [B, H, W, 3] or [B, T, H, W, 3] -> what each file holds (a one-frame video is an image)."""
    if output != "mp4" and pixels.ndim == 5:
        pixels = pixels[:, 0]
    return list(pixels)


def encode_item(item: np.ndarray, output: str, settings: EncodeSettings, fragments: tuple[int, ...] = ()) -> bytes:
    """`fragments`: mp4 frames per fragment (default: one fragment)."""
    if output == "mp4":
        return _mp4(item, settings, fragments or (item.shape[0],))
    buf = io.BytesIO()
    if output == "png":
        Image.fromarray(item).save(buf, format="PNG", compress_level=settings.png_compress_level)
    elif output == "jpeg":
        Image.fromarray(item).save(buf, format="JPEG", quality=settings.jpeg_quality)
    else:
        raise ValueError(f"{output!r} is not one of {ENCODED_OUTPUTS}")
    return buf.getvalue()


def _mp4(frames: np.ndarray, settings: EncodeSettings, fragments: tuple[int, ...]) -> bytes:
    writer = mp4_writer(frames.shape[2], frames.shape[1], settings)
    try:
        parts, start = [writer.init_segment()], 0
        for count in fragments:
            parts.append(writer.fragment(frames[start : start + count]))
            start += count
        return b"".join(parts)
    finally:
        writer.close()


def encode_all(
    pixels: np.ndarray, output: str, settings: EncodeSettings, fragments: tuple[int, ...] = ()
) -> list[bytes]:
    """Every item, one after the other (in-process callers; the service uses a pool)."""
    return [encode_item(item, output, settings, fragments) for item in items(pixels, output)]
