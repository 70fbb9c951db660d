"""Object names a caller may choose: a relative key under a location's prefix, checked so that it
can only name an object below that prefix (never another bucket, endpoint or folder), and the
names of a request's files (`{key}.{ext}` for one item, `{key}-{i}.{ext}` for several: the way
batch-decode names its files)."""

from __future__ import annotations

import posixpath
import re
import unicodedata
import uuid

MAX_KEY_CHARS = 512
# every segment of a key: well within a local file system's 255-byte names once an item's index,
# the extension and a temporary object's decoration (locations.py) are added to the last one
MAX_SEGMENT_BYTES = 200
MAX_OBJECT_BYTES = 1024  # S3's and GCS's bound on an object's name (UTF-8), prefix included
TEMPORARY_RANDOM_CHARS = 16
_TEMPORARY = re.compile(rf"\.(?P<name>.+)\.[0-9a-f]{{{TEMPORARY_RANDOM_CHARS}}}\.tmp")
# control and format characters (bidi overrides, zero-width joiners) and lone surrogates
_REFUSED_CATEGORIES = ("Cc", "Cf", "Cs")
_REFUSED_CHARS = "\\?#"  # a separator elsewhere; what would end a URI's path


class InvalidKey(ValueError):
    """A key that is not a plain relative object name; the message says why."""


def check_key(key: object) -> str:
    """`key` as given, when it is a relative name of segments separated by `/`, none empty, none
    starting with `.` (so no `.` or `..`, and no name of a temporary object), no control or
    format characters, no `\\`, `?` or `#`, at most MAX_KEY_CHARS; else InvalidKey."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidKey(f"must be at most {MAX_KEY_CHARS} characters, got {len(key)}")
    for ch in key:
        if ch in _REFUSED_CHARS or unicodedata.category(ch) in _REFUSED_CATEGORIES:
            raise InvalidKey(f"must not contain {ch!r} (U+{ord(ch):04X}); it names an object under the sink's prefix")
    if key.startswith("/"):
        raise InvalidKey(f"{key!r} is absolute; a key is relative to the sink's prefix")
    for segment in key.split("/"):
        if not segment:
            raise InvalidKey(f"{key!r} has an empty segment (a leading, trailing or doubled '/')")
        if segment.startswith("."):
            raise InvalidKey(f"{key!r}: segment {segment!r} starts with '.' (no '.', '..' or hidden names)")
        if len(segment.encode()) > MAX_SEGMENT_BYTES:
            raise InvalidKey(f"{key!r}: segment of {len(segment.encode())} bytes; at most {MAX_SEGMENT_BYTES}")
    return key


def temporary_name(path: str, random: str | None = None) -> str:
    """The temporary a file is written to before it is moved to `path`: beside it, hidden
    (`.{name}.{random}.tmp`), so no key (check_key: no segment starts with '.') can name it."""
    parent, name = posixpath.split(path)
    random = random if random is not None else uuid.uuid4().hex[:TEMPORARY_RANDOM_CHARS]
    return posixpath.join(parent, f".{name}.{random}.tmp")


def temporary_of(name: str) -> str | None:
    """The name whose temporary (temporary_name's, without its folder) `name` is; None for another name."""
    match = _TEMPORARY.fullmatch(name)
    return match["name"] if match else None


def object_names(key: object, ext: str, items: int, prefix: str = "") -> list[str]:
    """The names of `items` files under a prefix: `{key}.{ext}` for one, `{key}-{i}.{ext}` for
    several. `prefix`: the object key of the location they go under. The longest object the store
    is asked to make counts toward MAX_OBJECT_BYTES: the prefix, the item's suffix and the
    temporary's decoration, so a name the store would refuse is refused here, before any decode.
    Raises InvalidKey."""
    key = check_key(key)
    names = [f"{key}.{ext}"] if items == 1 else [f"{key}-{i}.{ext}" for i in range(items)]
    placeholder = "0" * TEMPORARY_RANDOM_CHARS
    longest = max(len(temporary_name(posixpath.join(prefix, n), placeholder).encode()) for n in names)
    if longest > MAX_OBJECT_BYTES:
        raise InvalidKey(
            f"makes an object name of {longest} bytes under the prefix, its temporary's decoration included; "
            f"at most {MAX_OBJECT_BYTES} (S3's and GCS's bound)"
        )
    return names
