"""Image outputs side by side: file size and encode time of png, jpeg, webp (lossy, lossless) and
avif at the deployment defaults (config.Encoding), on one 1024x1024 image, with ratios to PNG and
the PSNR of each decoded file against the pixels it encodes. Every encode runs as the service runs
it (engine/media/encoding.py's encode_item: one encoder thread per file).

The image is smooth colour gradients plus Gaussian noise (sigma 8): a decoded photo's smoothness
with some texture. Rounds interleave the formats so machine noise hits all alike; medians are
printed.

`--prices`: where engine/pricing/encode_cost.py's constants came from: CPU seconds per megapixel of
one encoder thread at every effort setting of each format (png level, webp method, avif speed, x264
preset, libvpx speed) and at the quality settings the price distinguishes, the slower of two
contents (the smooth image and uniform noise, the slowest content for these encoders), 512 px
images (AVIF speeds 0-3: 256 px), videos 8 frames of 256 px in one-frame and whole-clip fragments
(the slower). A few minutes here, most of it AVIF's and lossless WebP's slowest settings.

Usage: python bench/bench_image_outputs.py [--side 1024] [--rounds 5]
       python bench/bench_image_outputs.py --prices [--side 512] [--only avif webm ...]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from vae_service.config import Encoding
from vae_service.engine.media.encoding import EncodeSettings, encode_item

DEFAULTS = EncodeSettings.of(Encoding())
OUTPUTS = ("png", "jpeg", "webp", "avif", "mp4", "webm")
MP4_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
CASES = [
    ("png", "png", DEFAULTS),
    ("jpeg", "jpeg", DEFAULTS),
    ("webp", "webp", DEFAULTS),
    ("webp lossless", "webp", replace(DEFAULTS, webp_lossless=True)),
    ("avif", "avif", DEFAULTS),
]


def smooth_image(side: int, seed: int = 0, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    base = np.stack([np.sin(6 * x + 1 + shift) * 0.5 + 0.5, np.cos(5 * y + shift) * 0.5 + 0.5, x * y], -1) * 200 + 20
    return np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def noise_image(side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def encode_s(
    item: np.ndarray, output: str, settings: EncodeSettings, fragments: tuple[int, ...] = (), clock=time.perf_counter
) -> float:
    start = clock()
    encode_item(item, output, settings, fragments)
    return clock() - start


def cpu_s(item: np.ndarray, output: str, settings: EncodeSettings, fragments: tuple[int, ...] = ()) -> float:
    """The process's CPU seconds (every encoder here runs one thread): what a price counts, and
    what other work on a shared machine does not stretch as it stretches the wall time."""
    return encode_s(item, output, settings, fragments, time.process_time)


def compare(side: int, rounds: int) -> None:
    image = smooth_image(side)
    files = {name: encode_item(image, output, settings) for name, output, settings in CASES}  # warm-up
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    for _ in range(rounds):
        for name, output, settings in CASES:
            times[name].append(encode_s(image, output, settings))
    png_kib, png_ms = len(files["png"]) / 1024, statistics.median(times["png"]) * 1e3
    rows = []
    for name, _, _ in CASES:
        kib, ms = len(files[name]) / 1024, statistics.median(times[name]) * 1e3
        decoded = np.asarray(Image.open(io.BytesIO(files[name])).convert("RGB"))
        rows.append([name, f"{kib:.0f}", kib / png_kib, f"{ms:.1f}", ms / png_ms, f"{psnr(decoded, image):.1f}"])
    print_table(
        f"image outputs at the defaults, {side}x{side}, median of {rounds} rounds, one encoder thread",
        ["output", "KiB", "size / png", "encode ms", "time / png", "PSNR dB"],
        rows,
    )


def per_mp(output: str, settings: EncodeSettings, side: int) -> float:
    """Seconds per megapixel, the slower of the two contents (the faster of two runs each, one
    where the first took over half a second)."""
    worst = 0.0
    for image in (smooth_image(side), noise_image(side)):
        first = cpu_s(image, output, settings)
        worst = max(worst, first if first > 0.5 else min(first, cpu_s(image, output, settings)))
    return worst / (side * side / 1e6)


def video_per_mp(output: str, settings: EncodeSettings, side: int = 256, frames: int = 8) -> float:
    clips = (
        np.stack([smooth_image(side, i, shift=0.05 * i) for i in range(frames)]),
        np.stack([noise_image(side, i) for i in range(frames)]),
    )
    worst = max(cpu_s(clip, output, settings, f) for clip in clips for f in ((1,) * frames, (frames,)))
    return worst / (frames * side * side / 1e6)


def prices(side: int, only: list[str]) -> None:
    for output in only:  # imports and first calls (PyAV, PIL's plugins) outside the timings
        encode_s(smooth_image(16)[None] if output in ("mp4", "webm") else smooth_image(16), output, DEFAULTS)
    rows = []

    def row(output: str, setting: str, settings: EncodeSettings, rate: float | None = None) -> None:
        if output not in only:
            return
        rate = per_mp(output, settings, side) if rate is None else rate
        name = "webp lossless" if output == "webp" and settings.webp_lossless else output
        rows.append([name, setting, f"{rate:.4f}"])
        print(f"  {name} {setting}: {rate:.4f} s/MP", flush=True)

    for level in range(10):
        row("png", f"level {level}", replace(DEFAULTS, png_compress_level=level))
    for quality in (50, 95, 100):
        row("jpeg", f"quality {quality}", replace(DEFAULTS, jpeg_quality=quality))
    for method in range(7):
        row("webp", f"method {method}", replace(DEFAULTS, webp_method=method))
    for quality in (50, 75, 90, 95, 100):
        row("webp", f"quality {quality}", replace(DEFAULTS, webp_quality=quality))
    for method in range(7):
        row(
            "webp",
            f"method {method}, quality 100",
            replace(DEFAULTS, webp_lossless=True, webp_method=method, webp_quality=100),
        )
    for speed in range(10, -1, -1):  # speeds under 4 take seconds at 512 px: measured at 256
        settings = replace(DEFAULTS, avif_speed=speed)
        small = min(side, 256) if speed < 4 else side
        row(
            "avif",
            f"speed {speed}" + (f" ({small} px)" if small != side else ""),
            settings,
            per_mp("avif", settings, small),
        )
    for quality in (50, 75, 90, 95, 100):
        row("avif", f"quality {quality}", replace(DEFAULTS, avif_quality=quality))
    videos = [("mp4", f"preset {preset}", replace(DEFAULTS, mp4_preset=preset)) for preset in MP4_PRESETS]
    videos += [("mp4", f"crf {crf}", replace(DEFAULTS, mp4_crf=crf)) for crf in (0, 10, 23, 51)]
    videos += [("webm", f"speed {speed}", replace(DEFAULTS, webm_speed=speed)) for speed in range(8, -1, -1)]
    videos += [("webm", f"crf {crf}", replace(DEFAULTS, webm_crf=crf)) for crf in (0, 10, 20, 32, 63)]
    for output, setting, settings in videos:
        if output in only:
            row(output, setting, settings, video_per_mp(output, settings))
    print_table(
        f"encode seconds per megapixel, one thread, slower of smooth and noise, {side} px (videos: 8 frames of 256 px);"
        " the other settings at their defaults",
        ["output", "setting", "s / MP"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=int, default=None, help="image side in px (default 1024; --prices: 512)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prices", action="store_true", help="seconds per megapixel per setting (the price's table)")
    parser.add_argument("--only", nargs="*", default=list(OUTPUTS), help=f"--prices of these outputs, of {OUTPUTS}")
    args = parser.parse_args()
    print(f"Pillow {Image.__version__}, {os.cpu_count()} CPUs")
    if args.prices:
        prices(args.side or 512, args.only)
    else:
        compare(args.side or 1024, args.rounds)


if __name__ == "__main__":
    main()
