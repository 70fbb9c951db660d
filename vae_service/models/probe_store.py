"""Start-up probes kept on disk, so that every process of one architecture does not probe again: a
scaled-up replica, the replicas of one node, the next start of the service. Wan2.2's probes are
about 10 s of CPU at every start without it.

An entry is one JSON file named by a digest of everything its answer depends on: the
`Architecture` and the probe's name, torch's and diffusers' versions, and this package's source
(any change to the code that probes starts afresh). Only what a probe's codec turns into plain
JSON is kept (never pickle: a file that does not decode as its codec expects is ignored and probed
again); a probe without a codec stays in memory. Files are written whole (a temporary file
renamed), so processes sharing the directory never read half of one; a directory that cannot be
written costs the write, never the start.

Where: `VAE_SERVICE_PROBE_CACHE` (a directory; `off`: no files), else
`$XDG_CACHE_HOME/vae-service/probes` (`~/.cache/...`). Entries are a few hundred bytes each, a
handful per architecture; `rm -r` of the directory is always safe.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

STORE_ENV = "VAE_SERVICE_PROBE_CACHE"
T = TypeVar("T")


@dataclass(frozen=True)
class Codec(Generic[T]):
    """A probe's answer to plain JSON and back; `decode` raises (any exception) on what it did not write."""

    encode: Callable[[T], Any]
    decode: Callable[[Any], T]


@functools.cache
def code_version() -> str:
    """This package's source and the versions of what it probes with."""
    import diffusers
    import torch

    digest = hashlib.blake2b(f"torch {torch.__version__} diffusers {diffusers.__version__}".encode(), digest_size=16)
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class ProbeStore:
    def __init__(self, directory: Path):
        self.directory = directory
        self._unwritable = False

    @classmethod
    def from_environment(cls) -> ProbeStore | None:
        where = os.environ.get(STORE_ENV, "")
        if where.lower() == "off":
            return None
        if not where:
            where = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vae-service" / "probes")
        return cls(Path(where))

    def path(self, key: Any, probe: str) -> Path:
        """The file of (key, probe): `key` is a frozen dataclass of plain fields and types."""
        fields = {name: _plain(value) for name, value in sorted(vars(key).items())}
        text = json.dumps([code_version(), type(key).__name__, fields, probe], sort_keys=True)
        return self.directory / f"{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.json"

    def load(self, key: Any, probe: str, codec: Codec[T]) -> T | None:
        path = self.path(key, probe)
        try:
            text = path.read_text()
        except OSError:
            return None
        try:
            return codec.decode(json.loads(text))
        except Exception as error:  # written by something else, or damaged: probed again, rewritten
            log.warning("probe cache: ignoring %s (%s: %s)", path, type(error).__name__, error)
            return None

    def save(self, key: Any, probe: str, codec: Codec[T], value: T) -> None:
        if self._unwritable:
            return
        path = self.path(key, probe)
        text, written = json.dumps(codec.encode(value)), None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".", suffix=".tmp", delete=False) as f:
                written = f.name
                f.write(text)
            os.replace(written, path)
        except OSError as error:
            self._unwritable = True
            log.warning("probe cache: %s cannot be written (%s); probing at every start", self.directory, error)
            if written is not None:
                Path(written).unlink(missing_ok=True)  # a full disk: no half-written file left behind


def _plain(value: Any) -> Any:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


# ---- checked readers for codecs ---------------------------------------------------------------
def integer(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def number(value: Any) -> float:
    if type(value) not in (int, float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def sized(value: Any, n: int) -> list:
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"expected a list of {n}, got {value!r}")
    return value


def pair(value: Any, read: Callable[[Any], T]) -> tuple[T, T]:
    first, second = sized(value, 2)
    return read(first), read(second)


INTEGER: Codec[int] = Codec(int, integer)
