"""What the video writers share (fmp4.FragmentedMp4: libx264; webm.ClusteredWebm: libvpx-vp9): the checks on
their rate settings, an encoder opened through PyAV's codec API (no container), RGB frames turned into
BT.709 limited-range YUV 4:2:0, and VideoWriter, the base that checks a fragment's frames and encodes them
one packet per frame. The boxes or elements around the packets are each writer's own.

- Colour: the encoder is told BT.709 primaries, transfer and matrix, limited range, so its bitstream says
  what yuv_frame converts to; left unsaid, players guess (often BT.709) while libswscale converts with
  BT.601, and colours would shift.
- Determinism: the encoder's thread count is fixed, and swscale runs on one thread."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

BT709 = 1  # the same code for primaries, transfer and matrix (H.264 VUI, VP9 and FFmpeg's enums alike)
LIMITED_RANGE = 1  # FFmpeg's AVCOL_RANGE_MPEG


def check_rate(fps: int, threads: int, crf: int | None, bitrate: int | None, max_crf: int) -> None:
    """Refuses (ValueError) a frame rate, thread count or quality setting the writers cannot take."""
    if fps < 1:
        raise ValueError(f"fps must be a positive integer, not {fps}")
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    if (crf is None) == (bitrate is None):
        # crf has a default, so bitrate mode takes crf=None: a crf passed with a bitrate is a mistake to flag
        raise ValueError(f"set exactly one of crf and bitrate (crf=None for bitrate mode), not {crf=}, {bitrate=}")
    if crf is not None and not 0 <= crf <= max_crf:
        raise ValueError(f"crf must be within 0..{max_crf}, not {crf}")
    if bitrate is not None and bitrate < 1:
        raise ValueError(f"bitrate must be a positive number of bits per second, not {bitrate}")


def open_encoder(
    name: str,
    width: int,
    height: int,
    fps: int,
    threads: int,
    options: dict[str, str],
    *,
    global_header: bool = False,
    gop_size: int | None = None,
):
    """An open PyAV encoder `name` of yuv420p frames at `fps` (time base 1/fps), in BT.709 limited range, with
    `threads` threads and the encoder's own `options`; ValueError naming the encoder if it refuses them.
    `global_header`: parameter sets once, as extradata; `gop_size`: FFmpeg's distance between keyframes."""
    import av  # imported lazily: only video deployments need it

    codec = av.CodecContext.create(name, "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
    codec.time_base, codec.framerate = Fraction(1, fps), Fraction(fps)
    if global_header:
        codec.flags |= av.codec.context.Flags.global_header
    codec.thread_count = threads
    if gop_size is not None:
        codec.gop_size = gop_size
    codec.colorspace = codec.color_primaries = codec.color_trc = BT709
    codec.color_range = LIMITED_RANGE
    codec.options = options
    try:
        codec.open()
    except av.error.FFmpegError as error:
        raise ValueError(f"{name} refused {width}x{height} at {fps} fps with {options}: {error}") from error
    return codec


def yuv_frame(rgb: np.ndarray, pts: int, key: bool):
    """uint8 [H, W, 3] RGB -> an av.VideoFrame in BT.709 limited-range YUV 4:2:0 (what the video writers say
    their colours are), at `pts`, a forced keyframe when `key`."""
    import av

    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
    # one swscale thread, as for the encoders: callers choose the parallelism (say, a pool of encoders)
    frame = frame.reformat(format="yuv420p", dst_colorspace="itu709", dst_color_range=LIMITED_RANGE, threads=1)
    frame.pts = pts
    frame.pict_type = av.video.frame.PictureType.I if key else av.video.frame.PictureType.NONE
    return frame


class VideoWriter:
    """One video track written fragment by fragment: init_segment() first, then fragment() per chunk of frames.
    A subclass names its `encoder` and the option that keeps it from lagging (`lag_setting`, for the error),
    opens the encoder (open_encoder), builds `_init` and writes fragment() around `_encode`'s packets, adding
    the fragment's frames to `_frames_written` once it is written. Not thread-safe."""

    encoder: str
    lag_setting: str

    def __init__(self, width: int, height: int, fps: int, codec) -> None:
        self.width, self.height, self.fps = width, height, fps
        self._codec = codec
        self._init = b""
        self._frames_written = 0

    @property
    def duration_s(self) -> float:
        return self._frames_written / self.fps

    def init_segment(self) -> bytes:
        return self._init

    def resume(self, frames: int, fragments: int) -> None:
        """Go on with a file another writer of the same settings began, whose init segment was this
        one's: the next fragment is its `fragments`+1-th, from frame `frames` on."""
        self._frames_written = frames

    def close(self) -> None:
        self._codec = None  # PyAV frees the encoder with its last reference

    def _encode(self, frames: np.ndarray) -> list:
        """uint8 [T, H, W, 3] RGB, T >= 1 -> exactly one packet per frame, from frame `_frames_written` on, the
        first a forced keyframe."""
        codec = self._codec  # held for the whole fragment: a close meanwhile lets it finish
        if codec is None:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        expected = (self.height, self.width, 3)
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
            raise ValueError(f"frames must be a uint8 numpy array, not {getattr(frames, 'dtype', type(frames))}")
        if frames.ndim != 4 or frames.shape[1:] != expected or frames.shape[0] < 1:
            raise ValueError(f"frames must be [T >= 1, {', '.join(map(str, expected))}], not {list(frames.shape)}")

        packets = []
        for index, rgb in enumerate(frames):
            packets.extend(codec.encode(yuv_frame(rgb, self._frames_written + index, key=index == 0)))
        if len(packets) != len(frames):
            # a lagging encoder would put one chunk's frames into another's fragment, with wrong times
            raise RuntimeError(
                f"{self.encoder} gave {len(packets)} packets for {len(frames)} frames; {self.lag_setting} lost?"
            )
        return packets
