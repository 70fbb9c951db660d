"""Where files are read and written, through pyarrow.fs: S3 and S3-compatible stores
(`s3://bucket/prefix`), Google Cloud Storage (`gs://bucket/prefix`) or a local folder (`/path`,
`file:///path`, or for batch-decode a relative path).

Credentials never appear in a URI or a config: pyarrow takes them from the environment the way the
AWS and Google SDKs (and Ray) do: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN,
AWS_PROFILE and ~/.aws, instance and pod roles; GOOGLE_APPLICATION_CREDENTIALS or the metadata
server. A URI that carries any (`s3://key:secret@bucket`, `?access_key=`) is refused.

An S3 endpoint (a test store, MinIO, R2, Ceph ...) is named by `endpoint_override` (an option, or
the URI's query: `s3://bucket/prefix?endpoint_override=127.0.0.1:9000&scheme=http`), else by
AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, read here as pyarrow 26's FileSystem.from_uri reads
them (its S3FileSystem constructor alone does not). An endpoint is a host and a port, nothing
more: one with user info, a path, a query or a fragment (a presigned credential, a token) is refused
where it is named, the option or the variable said and its value not shown.

Every text that leaves this package naming a location goes through `redact` (a location) or
`scrub` (any message, pyarrow's own included: pyarrow echoes the endpoint it was given).

Every file is written whole or not at all (`Location.write_whole`): into a temporary object beside
it (`.{name}.{random}.tmp`), then moved to its name; on S3 and GCS a move is a server-side copy and
a delete, so the final name appears whole. A failure removes the temporary where the store still
answers; one left by a killed process or an unreachable store starts with `.` and ends `.tmp`.

In a local folder no symbolic link below the location's root is followed: each folder of a name is
opened (or made) relative to the one above it without following a link, the temporary is created
in that folder, never through a link, and the move replaces whatever is at the final name (a link
included) with the file, inside the folder held open. A name through a link is refused (KeyThroughLink);
a link swapped in while a write is in flight changes nothing (the folders are held open). A folder
standing at a file's name is never replaced: the write is refused (NameTakenByFolder), naming it.

Pure: nothing here knows of requests, Serve or Ray; pyarrow is imported on first use."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import posixpath
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from vae_service.storage.keys import InvalidKey, temporary_name

SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "file": "file"}
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
# what a URI's query may set (the same names as the options of open_location)
URI_OPTIONS = ("endpoint_override", "scheme", "region", "connect_timeout_s", "request_timeout_s", "retry_attempts")
OPTION_VALUES = {
    "endpoint_override": "host:port or http(s)://host:port",
    "scheme": "http or https",
    "region": "a region's name",
    "connect_timeout_s": "seconds > 0",
    "request_timeout_s": "seconds > 0",
    "retry_attempts": "an integer >= 1",
}
CREDENTIAL_OPTIONS = ("access_key", "secret_key", "session_token", "role_arn", "external_id", "access_token")
CHUNK_BYTES = 8 * 2**20  # a write checks whether it should stop between chunks of this size


class LocationError(ValueError):
    """A URI or option that names no location this package reads (the message says why)."""


class StoreUnavailable(OSError):
    """The store did not answer, or refused, a read or write (pyarrow's OSError, with its text)."""


class RefusedByStore(StoreUnavailable):
    """The store refused for good: a retry would be refused again (no such bucket, access denied, a
    refused credential, a name it does not take; a local folder's permissions)."""


# how pyarrow's S3 and GCS errors name a refusal that no retry passes; anything else (outages,
# throttling, 5xx, a cut connection) may pass on a retry
_REFUSALS = re.compile(
    r"NO_SUCH_BUCKET|ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|InvalidBucketName|NoSuchBucket"
    r"|AccessDenied|InvalidAccessKeyId|PERMISSION_DENIED|UNAUTHENTICATED|HTTP status 40[03]\b"
)


def refused_for_good(exc: OSError) -> bool:
    if isinstance(exc, PermissionError | IsADirectoryError | NotADirectoryError):
        return True
    return exc.errno == errno.EROFS or bool(_REFUSALS.search(str(exc)))


@dataclass(frozen=True)
class StoreOptions:
    endpoint_override: str | None = None  # host:port or http(s)://host:port
    scheme: str | None = None  # http | https
    region: str | None = None
    connect_timeout_s: float | None = None
    request_timeout_s: float | None = None
    retry_attempts: int | None = None

    def query(self) -> str:
        return urlencode({k: v for k, v in vars(self).items() if v is not None}, safe=":/")


class KeyThroughLink(InvalidKey):
    """A name whose folder is a symbolic link (or a file) inside a local location: refused, never followed."""


class NameTakenByFolder(InvalidKey):
    """A file's name where a folder stands, inside a local location: refused, the folder left as it was."""


@dataclass(frozen=True)
class StoredObject:
    """A file written whole: its URI (no query, no credentials), size in bytes and SHA-256 (hex)."""

    uri: str
    size: int
    sha256: str

    def to_map(self) -> dict:
        return {"uri": self.uri, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class ParsedUri:
    kind: str  # s3 | gs | file
    path: str  # the file system's path: "bucket/prefix" or "/abs/folder"
    options: StoreOptions

    @property
    def object_key(self) -> str:
        """The prefix within the bucket ("" for a bucket's root); a local path as it is."""
        return self.path if self.kind == "file" else self.path.partition("/")[2]


def parse_uri(uri: str, **options) -> ParsedUri:
    """Check a URI (and options beside its query) without opening anything. Raises LocationError."""
    if not isinstance(uri, str) or not uri.strip():
        raise LocationError(f"location {redact(uri)!r}: must be a non-empty string")
    if "://" not in uri:
        if "?" in uri or "#" in uri:  # what follows may be a secret: never shown
            raise LocationError(
                f"{redact(uri)}: a local folder's path has no query; use file:// or s3:// URIs for options"
            )
        return ParsedUri("file", os.path.abspath(uri), _options(uri, options))
    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # "Invalid IPv6 URL": a netloc it cannot read
        raise LocationError(f"{redact(uri)}: not a URI ({exc})") from None
    kind = SCHEMES.get(parts.scheme.lower())
    if kind is None:
        raise LocationError(f"{redact(uri)}: scheme {parts.scheme!r} is not one of {sorted(SCHEMES)} (or a local path)")
    if parts.fragment:
        raise LocationError(f"{redact(uri)}: a location has no #fragment")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    leaked = sorted(k for k in query if k in CREDENTIAL_OPTIONS)
    if "@" in parts.netloc or leaked:
        raise LocationError(
            f"{redact(uri)}: credentials never go in a URI or config; the store's SDK reads them from the "
            "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS)"
        )
    unknown = sorted(k for k in query if k not in URI_OPTIONS)
    if unknown:
        raise LocationError(f"{redact(uri)}: unknown option {_name_shown(unknown[0])!r} (allowed: {list(URI_OPTIONS)})")
    if kind == "file":
        if parts.netloc not in ("", "localhost") or query:
            raise LocationError(f"{redact(uri)}: a file:// URI names a local folder (file:///path), without options")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise LocationError(f"{redact(uri)}: a file:// URI needs an absolute path")
        _check_segments(uri, path)
        return ParsedUri("file", posixpath.normpath(path), StoreOptions())
    bucket = parts.netloc
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", bucket):
        raise LocationError(f"{redact(uri)}: names no bucket ({kind}://bucket/prefix; the endpoint goes apart)")
    prefix = unquote(parts.path).strip("/")
    _check_segments(uri, prefix)
    path = f"{bucket}/{prefix}" if prefix else bucket
    return ParsedUri(kind, path, _options(uri, {**query, **{k: v for k, v in options.items() if v is not None}}))


def redact(uri: object) -> str:
    """A location as every message, log line and answer shows it: without user info, with what
    follows a `:` after the host masked (a bucket has no port: `s3://bucket:secret` is a secret's
    place; an http(s) URI keeps a numeric port), each query value masked (either may hold a secret),
    no #fragment; a local path as it is, up to a `?` or `#` (parse_uri refuses a path with one). The
    one redaction: nothing that names a location is shown any other way."""
    text = str(uri)
    if "://" not in text:  # a local path has no query (parse_uri refuses one): what follows `?` or `#` masked
        found = re.search(r"[?#]", text)
        return f"{text[: found.end()]}***" if found else text
    try:
        parts = urlsplit(text)
        query = "&".join(f"{_name_shown(k)}=***" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
        if parts.query and not query:  # a query that is no k=v list (`?secret`): masked whole
            query = "***"
        shown = _host_shown(parts.scheme.lower(), parts.netloc.rpartition("@")[2])
        return f"{parts.scheme}://{shown}{parts.path}" + (f"?{query}" if query else "")
    except ValueError:  # a netloc urlsplit cannot read ("[::1"): its scheme alone
        return f"{text.partition('://')[0]}://(a location that cannot be parsed)"


def _name_shown(name: str) -> str:
    """An option's name as a message may show it: a plain identifier; anything else (a secret given
    where a name goes, `?SECRET`) as ***."""
    return name if _PLAIN_NAME.fullmatch(name) else "***"


def _host_shown(scheme: str, hostport: str) -> str:
    """A netloc's host, with its port where that is a port (digits, http or https), else `:***`."""
    end = hostport.index("]") + 1 if hostport.startswith("[") and "]" in hostport else len(hostport.partition(":")[0])
    host, rest = hostport[:end], hostport[end:]
    if not rest:
        return host
    port = rest[1:] if rest.startswith(":") else ""
    return f"{host}:{port}" if scheme in ("http", "https") and port.isdigit() else f"{host}:***"


# in an arbitrary message: a URI (scheme://...) up to a space or a quote, and a query's value
_URI_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s`'\"<>]*")
_QUERY_VALUE_IN_TEXT = re.compile(r"([?&][A-Za-z0-9_.~%-]+=)[^&\s`'\"<>]*")
# the environment's secrets (the AWS SDK's); a message holding one shows *** in its place
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_MIN_SECRET_CHARS = 4  # shorter values would mask ordinary words


def scrub(message: object, secrets: tuple[str, ...] = ()) -> str:
    """`message` (any text: a store's own error, pyarrow's, an exception's) fit to leave the
    service: every location-like substring (`scheme://...`) as `redact` shows it, every
    `?name=value` / `&name=value` value masked, and the known secret values (the environment's
    AWS credentials and `secrets`) as ***. Text without any is returned as it was."""
    text = _URI_IN_TEXT.sub(lambda m: redact(m.group(0)), str(message))
    text = _QUERY_VALUE_IN_TEXT.sub(lambda m: m.group(1) + ("" if m.group(0).endswith("=") else "***"), text)
    known = [os.environ.get(name) or "" for name in SECRET_VARIABLES] + [str(s) for s in secrets]
    for secret in sorted({s for s in known if len(s) >= _MIN_SECRET_CHARS}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _check_segments(uri: str, path: str) -> None:
    if any(s in (".", "..") for s in path.split("/")):
        raise LocationError(f"{redact(uri)}: '.' and '..' are not allowed in a location's path")


def _options(uri: str, given: dict) -> StoreOptions:
    unknown = sorted(k for k in given if k not in URI_OPTIONS)
    if unknown:
        raise LocationError(f"{redact(uri)}: unknown option {_name_shown(unknown[0])!r} (allowed: {list(URI_OPTIONS)})")
    typed: dict = {}
    for key, value in given.items():
        if value is None:
            continue
        try:
            if key in ("connect_timeout_s", "request_timeout_s"):
                typed[key] = float(value)
                ok = typed[key] > 0
            elif key == "retry_attempts":
                typed[key] = int(value)
                ok = typed[key] >= 1
            else:
                typed[key] = str(value)
                ok = bool(typed[key]) and (key != "scheme" or typed[key] in ("http", "https"))
        except (TypeError, ValueError):
            ok = False
        if key == "endpoint_override" and "@" in str(value):  # user:secret@host: a credential, said nowhere
            raise LocationError(
                f"{redact(uri)}: credentials never go in endpoint_override; the store's SDK reads them from the "
                "environment"
            )
        if key == "endpoint_override" and ok and not plain_endpoint(typed[key]):
            raise LocationError(f"{redact(uri)}: option endpoint_override is not valid: {ENDPOINT_RULE}")
        if not ok:
            raise LocationError(f"{redact(uri)}: option {key} is not valid: {OPTION_VALUES[key]} (its value not shown)")
    return StoreOptions(**typed)


ENDPOINT_RULE = (
    "host:port or http(s)://host:port, without user info, path, query or fragment (its value not shown; "
    "credentials come from the environment)"
)


def plain_endpoint(endpoint: str) -> bool:
    """Whether `endpoint` is `host[:port]` or `http(s)://host[:port][/]` and nothing more: no user
    info, path, query or fragment (a presigned credential or a token would be echoed by pyarrow's
    errors), no space or control character."""
    if not endpoint or any(ch.isspace() or not ch.isprintable() for ch in endpoint):
        return False
    try:
        parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        port = parts.port  # a port that is not a number raises ValueError
    except ValueError:
        return False
    plain = not (parts.query or parts.fragment or "?" in endpoint or "#" in endpoint or "@" in parts.netloc)
    return (
        plain
        and parts.scheme in ("", "http", "https")
        and parts.path in ("", "/")
        and bool(parts.hostname)
        and (port is None or 0 < port < 65536)
    )


def check_location(uri: str, absolute: bool = False, **options) -> str:
    """`uri` when it names a location (for a config: `absolute`, a local folder must be given as
    /path or file:///path); raises LocationError."""
    if absolute and "://" not in uri and not uri.startswith("/"):
        raise LocationError(f"{redact(uri)}: a local folder must be an absolute path (/path or file:///path)")
    parse_uri(uri, **options)
    return uri


def open_location(uri: str, **options) -> Location:
    """The location a URI (or a local path) names; `options` (StoreOptions' fields, None: unset)
    beside the URI's query. Opens no connection: a store that is down fails the first read or write."""
    parsed = parse_uri(uri, **options)
    store = parsed.options
    if parsed.kind == "s3" and store.endpoint_override is None:  # as pyarrow's from_uri reads them
        variable = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v)), None)
        endpoint = os.environ[variable] if variable else None
        if endpoint is not None and not plain_endpoint(endpoint):
            raise LocationError(f"{redact(uri)}: the environment's {variable} is not a valid endpoint: {ENDPOINT_RULE}")
        store = replace(store, endpoint_override=endpoint)
    fs = _filesystem(parsed.kind, store)
    if parsed.kind == "file":
        return Location(fs, parsed.path, "file://" + quote(parsed.path), "", parsed.path)
    shown = f"{parsed.kind}://{quote(parsed.path)}"
    return Location(fs, parsed.path, shown, parsed.options.query(), parsed.path)


@functools.lru_cache(maxsize=64)
def _filesystem(kind: str, options: StoreOptions):
    import pyarrow.fs as pafs

    if kind == "file":
        return pafs.LocalFileSystem()
    endpoint = options.endpoint_override
    if kind == "gs":
        kwargs: dict = {"endpoint_override": endpoint, "scheme": options.scheme}
        if options.request_timeout_s is not None:
            from datetime import timedelta

            kwargs["retry_time_limit"] = timedelta(seconds=options.request_timeout_s)
        return pafs.GcsFileSystem(**{k: v for k, v in kwargs.items() if v is not None})
    kwargs = {
        "endpoint_override": endpoint,
        "scheme": options.scheme,
        "region": options.region,
        "connect_timeout": options.connect_timeout_s,
        "request_timeout": options.request_timeout_s,
    }
    if options.retry_attempts is not None:
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=options.retry_attempts)
    return pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})


@dataclass(frozen=True)
class Location:
    """A folder or a file in a store: `fs` (a pyarrow FileSystem), `path` (the file system's path:
    "bucket/prefix" or "/abs/path"), `uri` (to show and answer: no query, no credentials) and
    `query` (the non-secret options of the URI it was opened from: `spec` reopens it); `root`: the
    path it was opened at (its children keep it: no link below it is followed when writing)."""

    fs: object
    path: str
    uri: str
    query: str = ""
    root: str = ""

    def __str__(self) -> str:
        return self.path if self.local else self.uri

    @property
    def local(self) -> bool:
        return self.uri.startswith("file://")

    @property
    def spec(self) -> str:
        """A string open_location turns back into this location (a local path, or the URI with its
        options): what crosses to Ray workers."""
        if self.local:
            return self.path
        return f"{self.uri}?{self.query}" if self.query else self.uri

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    def child(self, name: str) -> Location:
        """The file or folder `name` (a relative name, `/` between segments; keys.check_key's) below."""
        return replace(
            self,
            path=f"{self.path.rstrip('/')}/{name}",
            uri=f"{self.uri.rstrip('/')}/{quote(name)}",
            root=self.root or self.path,
        )

    @property
    def object_key(self) -> str:
        """The object's name within its bucket ("" for a bucket); a local path as it is."""
        return self.path if self.local else self.path.partition("/")[2]

    # ---- reading ---------------------------------------------------------------------------------
    def _type(self):
        with _store_errors(self):
            return self.fs.get_file_info(self.path).type

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        """A folder, or a prefix under which objects exist (object stores have no folders)."""
        import pyarrow.fs as pafs

        return self._type() == pafs.FileType.Directory

    def all_exist(self, names: list[str]) -> bool:
        """Whether a file exists under each of these names (one listing call for all of them)."""
        import pyarrow.fs as pafs

        with _store_errors(self):
            infos = self.fs.get_file_info([self.child(n).path for n in names])
        return all(info.type == pafs.FileType.File for info in infos)

    def files(self, recursive: bool = False) -> list[Location]:
        """The files below this folder, sorted by path."""
        import pyarrow.fs as pafs

        with _store_errors(self):
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=recursive))
        base = self.path.rstrip("/") + "/"
        found = []
        for info in sorted(infos, key=lambda i: i.path):
            relative = info.path[len(base) :] if info.path.startswith(base) else info.base_name
            if info.type == pafs.FileType.File:
                found.append(self.child(relative))
        return found

    def open_input(self):
        """A seekable binary file (pyarrow's RandomAccessFile: read(n), seek, size)."""
        with _store_errors(self):
            return self.fs.open_input_file(self.path)

    def read_bytes(self) -> bytes:
        with self.open_input() as f, _store_errors(self):
            return f.read()

    # ---- writing ---------------------------------------------------------------------------------
    def make_dirs(self) -> None:
        """Create the folder on a local file system (object stores need none: nothing is made there)."""
        if self.local:
            with _store_errors(self, writing=True):
                self.fs.create_dir(self.path, recursive=True)

    def delete(self) -> None:
        """Remove this file (a link there is removed, not followed); gone already is no error."""
        with _store_errors(self, writing=True):
            try:
                self.fs.delete_file(self.path)
            except FileNotFoundError:
                pass

    def write_whole(self, data: bytes, check: Callable[[], None] | None = None) -> StoredObject:
        """Write `data` under this name whole or not at all: a temporary object beside it, then a
        move. `check` is called between chunks and before the move: whatever it raises stops the
        write (the temporary removed, nothing under this name). Store failures raise StoreUnavailable."""
        digest = hashlib.sha256(data).hexdigest()
        check = check or (lambda: None)
        if self._on_local_disk():
            with _store_errors(self, writing=True):
                self._write_local(memoryview(data), check)
            return StoredObject(self.uri, len(data), digest)
        temporary = temporary_name(self.path)
        try:
            with _store_errors(self, writing=True):
                if self.local:
                    self.fs.create_dir(posixpath.dirname(self.path), recursive=True)
                with self.fs.open_output_stream(temporary) as out:
                    _write_chunks(out.write, memoryview(data), check)
                check()
                self.fs.move(temporary, self.path)
        except BaseException:
            _discard(self.fs, temporary)
            raise
        return StoredObject(self.uri, len(data), digest)

    def _on_local_disk(self) -> bool:
        import pyarrow.fs as pafs

        return self.local and isinstance(self.fs, pafs.LocalFileSystem)

    def _write_local(self, view: memoryview, check: Callable[[], None]) -> None:
        root = self.root or posixpath.dirname(self.path)
        *folders, name = posixpath.relpath(self.path, root).split("/")
        os.makedirs(root, exist_ok=True)  # the root itself is the operator's choice: a link there is theirs
        folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in folders:
                inner = _open_folder_below(folder, part, self.path)
                os.close(folder)
                folder = inner
            relative = posixpath.relpath(self.path, root)
            _refuse_folder_at(folder, name, relative)
            temporary = posixpath.basename(temporary_name(name))
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            out = os.open(temporary, flags, 0o666, dir_fd=folder)
            try:
                with os.fdopen(out, "wb") as f:
                    _write_chunks(f.write, view, check)
                check()
                try:
                    os.rename(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)  # a link there is replaced
                except OSError as exc:  # a folder made at its name meanwhile
                    if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    _refuse_folder_at(folder, name, relative)
                    raise
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=folder)
                raise
        finally:
            os.close(folder)


def _write_chunks(write: Callable, view: memoryview, check: Callable[[], None]) -> None:
    for start in range(0, max(len(view), 1), CHUNK_BYTES):
        check()
        write(view[start : start + CHUNK_BYTES])


def _open_folder_below(parent: int, part: str, path: str) -> int:
    """The folder `part` inside the open folder `parent` (made if missing), opened without following
    a link. A link or a file there: KeyThroughLink."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, dir_fd=parent)
        return os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        link = stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode)
        what = "a symbolic link" if link else "not a folder"
        raise KeyThroughLink(f"{part!r} in {path!r} is {what}; links are never followed below a location") from None


def _refuse_folder_at(parent: int, name: str, relative: str) -> None:
    """NameTakenByFolder where a folder (not a link to one) stands at `name` in the open folder `parent`."""
    try:
        taken = stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return
    if taken:
        raise NameTakenByFolder(
            f"{relative!r} is taken by a folder, so no file can be written under that name; nothing was written "
            "there (choose another name, or remove the folder)"
        )


def _discard(fs, path: str) -> None:
    """Remove a temporary, where the store still answers (else it stays: a `.` name ending .tmp)."""
    try:
        fs.delete_file(path)
    except Exception:
        pass


@contextmanager
def _store_errors(location: Location, writing: bool = False) -> Iterator[None]:
    """pyarrow's OSErrors as StoreUnavailable naming the location (RefusedByStore where no retry would
    pass); a missing file, when reading, stays a FileNotFoundError (the caller says what was missing)."""
    try:
        yield
    except StoreUnavailable:
        raise
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not writing:
            raise
        kind = RefusedByStore if refused_for_good(exc) else StoreUnavailable
        raise kind(f"{location.uri}: {scrub(' '.join(str(exc).split()))}") from exc
