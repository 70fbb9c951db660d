"""What encoding a request's files costs, priced before it is decoded: one encoder thread's seconds
per megapixel for its output at the deployment's `encoding` settings, times the pixels of all its
items and frames, against `limits.max_encode_seconds` (413 naming it). The rates are fixed per
deployment (its settings are); the limit is live.

The rates are upper bounds, measured on the development CPU (2 cores, 2026-12-05; Pillow 13.0 with
zlib, libjpeg-turbo, libwebp 1.6 and libavif 1.4.2 with aom; libx264 and libvpx-vp9 through PyAV)
by `python bench/bench_image_outputs.py --prices`: each effort setting's CPU time on one thread, the
slower of a smooth image and uniform noise (the slowest content for all of these encoders: AVIF takes 6x
longer on it), 512 px images (AVIF speeds 0-3: 256 px), videos 8 frames of 256 px in one-frame
and whole-clip fragments, the slower; then MARGIN over all of it. Quality matters less than effort and
is priced by one step where it costs more than the default's time. A price is CPU work, not
latency: `encoding.threads` encode a request's items side by side, and a faster CPU takes less.
"""

from __future__ import annotations

from vae_service.config import Limits
from vae_service.engine.media.encoding import EncodeSettings
from vae_service.engine.request.decode_request import IMAGE_OUTPUTS, VIDEO_OUTPUTS
from vae_service.engine.request.errors import LimitExceeded

MARGIN = 1.5  # over the measured rates: other content, a busier machine, the quality steps' roughness

# CPU seconds per megapixel on one thread, the slower content (the bench's --prices table; the
# larger of two runs, one timed by the wall clock on a quieter machine, one by CPU time)
PNG_LEVEL = (0.065, 0.122, 0.120, 0.123, 0.142, 0.143, 0.145, 0.144, 0.144, 0.145)  # compress_level 0-9
JPEG = 0.009  # quality 100 (95: 0.008, 50: 0.0056)
WEBP_METHOD = (0.085, 0.104, 0.120, 0.170, 0.169, 0.193, 0.450)  # lossy, method 0-6, quality 90
WEBP_OVER_90 = 1.55  # lossy quality over 90, at method 0: 95 takes 1.12x, 100 1.52x quality 90's time
WEBP_LOSSLESS_METHOD = (0.033, 0.210, 0.310, 2.54, 2.54, 2.52, 20.1)  # quality 100 (lossless: its effort)
AVIF_SPEED = (114.0, 44.7, 37.2, 20.7, 8.79, 7.81, 1.17, 0.833, 0.650, 0.161, 0.216)  # speed 0-10, quality 75
AVIF_OVER_75 = 1.5  # quality over 75, at speed 8: 90 takes 1.41-1.47x, 95 1.42x, 100 0.81x quality 75's time
MP4_PRESET = {  # x264 at crf 23
    "ultrafast": 0.022,
    "superfast": 0.051,
    "veryfast": 0.057,
    "faster": 0.097,
    "fast": 0.199,
    "medium": 0.221,
    "slow": 0.551,
    "slower": 0.826,
    "veryslow": 1.11,
}
MP4_CRF = ((23, 1.0), (10, 1.55), (0, 2.35))  # (lowest crf, factor): crf 10 takes 1.55x, 0 2.33x crf 23's time
WEBM_SPEED = (7.91, 1.85, 1.26, 1.28, 0.418, 0.135, 0.135, 0.125, 0.106)  # libvpx cpu-used 0-8, crf 32
WEBM_CRF = ((32, 1.0), (0, 1.55))  # crf 20 takes 1.05-1.17x, 10 1.16-1.26x, 0 1.47-1.52x crf 32's time


def _crf_factor(steps: tuple[tuple[int, float], ...], crf: int | None) -> float:
    """A bitrate instead of a crf (None) is priced as the slowest crf."""
    if crf is None:
        return steps[-1][1]
    return next(factor for lowest, factor in steps if crf >= lowest)


RATES = {
    "png": lambda s: PNG_LEVEL[s.png_compress_level],
    "jpeg": lambda s: JPEG,
    "webp": lambda s: (
        WEBP_LOSSLESS_METHOD[s.webp_method]
        if s.webp_lossless
        else WEBP_METHOD[s.webp_method] * (WEBP_OVER_90 if s.webp_quality > 90 else 1.0)
    ),
    "avif": lambda s: AVIF_SPEED[s.avif_speed] * (AVIF_OVER_75 if s.avif_quality > 75 else 1.0),
    "mp4": lambda s: MP4_PRESET[s.mp4_preset] * _crf_factor(MP4_CRF, None if s.mp4_bitrate else s.mp4_crf),
    "webm": lambda s: WEBM_SPEED[s.webm_speed] * _crf_factor(WEBM_CRF, None if s.webm_bitrate else s.webm_crf),
}


class EncodePrice:
    """A deployment's encode prices, fixed at start-up from its settings."""

    def __init__(self, settings: EncodeSettings):
        self.per_megapixel = {output: MARGIN * rate(settings) for output, rate in RATES.items()}

    def seconds(self, output: str, pixels: int) -> float:
        """Estimated seconds of one encoder thread for `pixels` (all items and frames); 0 unencoded."""
        return self.per_megapixel.get(output, 0.0) * pixels / 1e6

    def check(self, output: str, pixels: int, limits: Limits) -> None:
        seconds, limit = self.seconds(output, pixels), limits.max_encode_seconds
        if seconds <= limit:
            return
        kin = IMAGE_OUTPUTS if output in IMAGE_OUTPUTS else VIDEO_OUTPUTS
        within = [repr(o) for o in kin if self.seconds(o, pixels) <= limit]  # what this request could ask for
        raise LimitExceeded(
            "output",
            f"encoding {pixels} pixels as '{output}' would take about {seconds:.3g} s of one encoder thread "
            f"({self.per_megapixel[output]:.3g} s per megapixel at this deployment's settings), over the limit of "
            f"{limit:g} (max_encode_seconds): ask for fewer items, or for {' or '.join([*within, repr('uint8')])}",
        )

    def describe(self) -> dict[str, float]:
        return {output: round(rate, 4) for output, rate in self.per_megapixel.items()}
