"""Where a decoded input goes: files named after the input, written whole or not at all, so that
a rerun can tell finished inputs from the rest by their files alone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# npy: the service's `uint8` answer, [B, H, W, 3] or [B, T, H, W, 3], one file per input
BATCH_OUTPUTS = ("png", "jpeg", "mp4", "npy")


def check_name(name: str) -> str:
    """An input's name becomes a file name: nothing that could point elsewhere."""
    if not name or name != Path(name).name or name.startswith(".") or "\x00" in name:
        raise ValueError(f"name {name!r}: must be a plain file name (no directories, not hidden)")
    return name


class OutputFolder:
    def __init__(self, folder: str | Path, output: str):
        if output not in BATCH_OUTPUTS:
            raise ValueError(f"output {output!r}: one of {list(BATCH_OUTPUTS)}")
        self.folder, self.output = Path(folder), output

    def paths(self, name: str, items: int) -> list[Path]:
        """One npy per input; otherwise one file per item, suffixed by its index when there are several."""
        name = check_name(name)
        if self.output == "npy" or items == 1:
            return [self.folder / f"{name}.{self.output}"]
        return [self.folder / f"{name}-{i}.{self.output}" for i in range(items)]

    @staticmethod
    def finished(paths: list[Path]) -> bool:
        return all(p.is_file() for p in paths)

    def write(self, paths: list[Path], output) -> None:
        """`output`: encoded files (one per path) or, for npy, the uint8 pixels as one array."""
        blobs = [_npy_bytes(output)] if self.output == "npy" else output
        if len(blobs) != len(paths):
            raise ValueError(f"{len(blobs)} outputs for {len(paths)} files")
        for path, blob in zip(paths, blobs, strict=True):
            _write_whole(path, blob)


def _npy_bytes(pixels) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.asarray(pixels), allow_pickle=False)
    return buf.getvalue()


def _write_whole(path: Path, blob: bytes) -> None:
    # a run stopped mid-write leaves only a hidden temporary, never a truncated output
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
