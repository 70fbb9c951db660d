"""Where a decoded input goes: files named after the input (storage's object_names, as a request's
sink names them), in a local folder or object storage (`s3://bucket/prefix`, `gs://...`: through
vae_service/storage), written whole or not at all, so that a rerun can tell finished inputs from
the rest by their files alone."""

from __future__ import annotations

import posixpath
from pathlib import Path

import numpy as np

from vae_service.storage import Location, object_names, open_location, temporary_of

# npy: the service's `uint8` answer, [B, H, W, 3] or [B, T, H, W, 3], one file per input
BATCH_OUTPUTS = ("png", "jpeg", "webp", "avif", "mp4", "webm", "npy")


def check_name(name: str) -> str:
    """An input's name becomes a file name: nothing that could point elsewhere."""
    if not name or name != Path(name).name or name.startswith(".") or "\x00" in name:
        raise ValueError(f"name {name!r}: must be a plain file name (no directories, not hidden)")
    return name


class OutputFolder:
    def __init__(self, folder: str | Path | Location, output: str):
        """`folder`: a local path, a URI (s3://bucket/prefix?endpoint_override=..., gs://..., file://...)
        or a Location (raises storage's LocationError, a ValueError, for one that names none)."""
        if output not in BATCH_OUTPUTS:
            raise ValueError(f"output {output!r}: one of {list(BATCH_OUTPUTS)}")
        self.folder = folder if isinstance(folder, Location) else open_location(str(folder))
        self.output = output

    def paths(self, name: str, items: int) -> list[Location]:
        """One npy per input; otherwise one file per item, suffixed by its index when there are several."""
        names = object_names(check_name(name), self.output, 1 if self.output == "npy" else items)
        return [self.folder.child(n) for n in names]

    def finished(self, paths: list[Location]) -> bool:
        """Whether every file exists (on a store: one existence check per file, no listing)."""
        return self.folder.all_exist([p.name for p in paths])

    def write(self, paths: list[Location], output) -> None:
        """`output`: encoded files (one per path) or, for npy, the uint8 pixels as one array. Each
        written whole (a temporary beside it, then moved): a run stopped mid-write leaves only a
        hidden temporary, never a truncated output."""
        blobs = [_npy_bytes(output)] if self.output == "npy" else output
        if len(blobs) != len(paths):
            raise ValueError(f"{len(blobs)} outputs for {len(paths)} files")
        for path, blob in zip(paths, blobs, strict=True):
            path.write_whole(blob)

    def discard_temporaries(self, names: set[str]) -> int:
        """Remove the temporaries of these files that interrupted writes left (a killed process, a
        store that stopped before the temporary could be removed); how many. Names are matched
        without their extension: a job's default output (png or mp4) is known once its model loads."""
        if not self.folder.is_dir():
            return 0
        stems = {posixpath.splitext(n)[0] for n in names}
        stale = [f for f in self.folder.files() if _stem_of_output(temporary_of(f.name)) in stems]
        for f in stale:
            f.delete()
        return len(stale)


def _stem_of_output(name: str | None) -> str | None:
    stem, ext = posixpath.splitext(name or "")
    return stem if ext[1:] in BATCH_OUTPUTS else None


def _npy_bytes(pixels) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.asarray(pixels), allow_pickle=False)
    return buf.getvalue()
