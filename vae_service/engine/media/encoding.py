"""Encoding decoded pixels as files (PNG, JPEG, WebP, AVIF, MP4, WebM), one batch item at a time, so that a pool can
encode the items of a request in parallel while the device decodes the next batch. Measured here
with PIL on one 1024x1024 image: PNG 22-111 ms at the default level 6 (content-dependent), JPEG
q95 2-7 ms; PNG level 1 (our default) writes ~10-30% larger files several times faster. At the
defaults (bench/bench_image_outputs.py, a smooth image with noise): WebP 43 ms, 14% of PNG's
bytes; AVIF 84 ms on one thread, 9%; lossless WebP 61 ms, PNG's size. What each costs is priced
before decoding (engine/pricing/encode_cost.py, `max_encode_seconds`).

A video is fragmented, MP4 (engine/media/fmp4.py) and WebM (engine/media/webm.py, a fragment is a
Cluster) alike: an init segment, then one fragment per latent frame's worth of frames, each starting
with a keyframe (`fragment_frames`). A streamed answer writes the same fragments as its frames
decode (serving/outputs/video_stream.py), so a whole answer and a stream of the same frames are the same
bytes."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vae_service.engine.media.fmp4 import FragmentedMp4
from vae_service.engine.media.frames import frame_counts
from vae_service.engine.media.webm import ClusteredWebm
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
    """Frames per video fragment: one latent frame's worth each (the decoder's own law, as the stream
    hands them over), so a player can start on the first latent frame's frames."""
    counts = frame_counts(total, latent_frames, law)
    if sum(counts) != total or min(counts) < 1:  # a decoder off its law: the frames spread evenly
        counts = frame_counts(total, latent_frames, None)
    return tuple(n for n in counts if n > 0)


def mp4_writer(width: int, height: int, settings: EncodeSettings) -> FragmentedMp4:
    crf = None if settings.mp4_bitrate is not None else settings.mp4_crf
    return FragmentedMp4(width, height, settings.mp4_fps, crf, settings.mp4_bitrate, settings.mp4_preset)


def webm_writer(width: int, height: int, settings: EncodeSettings) -> ClusteredWebm:
    crf = None if settings.webm_bitrate is not None else settings.webm_crf
    return ClusteredWebm(width, height, settings.mp4_fps, crf, settings.webm_bitrate, settings.webm_speed)


VIDEO_WRITERS = {"mp4": mp4_writer, "webm": webm_writer}


def video_writer(output: str, width: int, height: int, settings: EncodeSettings) -> FragmentedMp4 | ClusteredWebm:
    """The writer of a video output: init_segment(), then fragment(frames) per fragment, close()."""
    return VIDEO_WRITERS[output](width, height, settings)


def items(pixels: np.ndarray, output: str) -> list[np.ndarray]:
    """uint8 [B, H, W, 3] or [B, T, H, W, 3] -> what each file holds (a one-frame video is an image)."""
    if output not in VIDEO_OUTPUTS and pixels.ndim == 5:
        pixels = pixels[:, 0]
    return list(pixels)


# PIL's save arguments of each image output (PIL's own encoders: zlib, libjpeg, libwebp, libavif
# with aom). One encoder thread each, as x264's: the encoder pool chooses the parallelism, and the
# encode price (engine/pricing/encode_cost.py) is one thread's. Lossless WebP reads `quality` as
# its effort (0: fastest), as libwebp does.
IMAGE_ENCODERS = {
    "png": lambda s: {"format": "PNG", "compress_level": s.png_compress_level},
    "jpeg": lambda s: {"format": "JPEG", "quality": s.jpeg_quality},
    "webp": lambda s: {
        "format": "WEBP",
        "quality": s.webp_quality,
        "lossless": s.webp_lossless,
        "method": s.webp_method,
    },
    "avif": lambda s: {"format": "AVIF", "quality": s.avif_quality, "speed": s.avif_speed, "max_threads": 1},
}


def encode_item(item: np.ndarray, output: str, settings: EncodeSettings, fragments: tuple[int, ...] = ()) -> bytes:
    """`fragments`: a video's frames per fragment (default: one fragment)."""
    if output in VIDEO_WRITERS:
        return _video(item, output, settings, fragments or (item.shape[0],))
    if output not in IMAGE_ENCODERS:
        raise ValueError(f"{output!r} is not one of {ENCODED_OUTPUTS}")
    buf = io.BytesIO()
    Image.fromarray(item).save(buf, **IMAGE_ENCODERS[output](settings))
    return buf.getvalue()


def _video(frames: np.ndarray, output: str, settings: EncodeSettings, fragments: tuple[int, ...]) -> bytes:
    writer = video_writer(output, frames.shape[2], frames.shape[1], settings)
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
