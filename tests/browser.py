"""A real browser as a test client: headless Chromium plays a streamed fragmented MP4 or WebM through
Media Source Extensions (tests/browser_page.html) and reports what it saw back over HTTP.

`PageServer` serves the page, relays the stream from a source the test gives it, and collects the
page's reports; `Chromium` runs the browser on the page; `browser_page` does both. The relay holds
the response open after the first media fragment (mp4: moof + mdat; webm: a Cluster) until the page
reports buffered frames, so a `buffered` report with `open: true` proves the browser buffered video
before the answer was over.

    @contextlib.contextmanager
    def source():
        with httpx.Client() as client, client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, response.read()
            yield response.headers["content-type"], response.iter_raw()

    require_chromium()
    with browser_page(source) as page:
        page.wait_for("buffered")["open"]  # True: buffered while the response was still open
        ended = page.wait_for("ended")
"""

import contextlib
import dataclasses
import http.server
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.ports import free_port

PAGE = Path(__file__).with_name("browser_page.html")
REQUIRED_ENV = "VAE_SERVICE_BROWSER_REQUIRED"

# A source: a callable returning (content_type, byte chunks), or a context manager that yields that
# pair (so an HTTP response it opens is closed when the relay is done with it)
Source = Callable[[], "tuple[str, Iterable[bytes]] | contextlib.AbstractContextManager[tuple[str, Iterable[bytes]]]"]

# flags for headless Chromium as root, without a display or a GPU
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # root can't use the setuid/namespace sandbox
    "--disable-gpu",
    "--disable-dev-shm-usage",  # a container's /dev/shm is 64 MB: shared memory in /tmp instead
    "--autoplay-policy=no-user-gesture-required",
    "--mute-audio",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-breakpad",  # no crashpad handler (it would run outside the process group)
    "--enable-logging=stderr",  # the page's console messages land in the log too
)


def chromium_path() -> str | None:
    return shutil.which("chromium")


def chromium_available() -> bool:
    return chromium_path() is not None


def require_chromium() -> str:
    """Chromium's path; skips the test without it, or fails it where REQUIRED_ENV=1 (CI)."""
    path = chromium_path()
    if path is None:
        message = "chromium is not installed (apt-get install --no-install-recommends chromium)"
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(f"{message}, and {REQUIRED_ENV}=1 requires it")
        pytest.skip(message)
    return path


# ---- top-level ISO BMFF boxes


class Box(NamedTuple):
    type: str  # four characters, e.g. "moof"
    start: int  # offset of the box's header
    header: int  # header length: 8, or 16 with a 64-bit largesize
    end: int  # offset just past the box

    @property
    def payload_start(self) -> int:
        return self.start + self.header


def box_header(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[str, int, int] | None:
    """(type, header length, box size) of the box at offset, or None while the header is incomplete.
    A size of 0 (the box runs to the end of the file) comes back as -1."""
    if len(data) - offset < 8:
        return None
    size = int.from_bytes(data[offset : offset + 4], "big")
    kind = bytes(data[offset + 4 : offset + 8]).decode("latin-1")
    if size == 1:
        if len(data) - offset < 16:
            return None
        size = int.from_bytes(data[offset + 8 : offset + 16], "big")
        header = 16
    elif size == 0:
        return kind, 8, -1
    else:
        header = 8
    if size < header:
        raise ValueError(f"box {kind!r} at offset {offset} has size {size}, under its {header}-byte header")
    return kind, header, size


def iter_boxes(data: bytes | bytearray | memoryview, offset: int = 0) -> Iterator[Box]:
    """The complete top-level boxes in data from offset on; stops at an incomplete one (or one that runs
    to the end of the file)."""
    while True:
        found = box_header(data, offset)
        if found is None or found[2] < 0 or offset + found[2] > len(data):
            return
        kind, header, size = found
        yield Box(kind, offset, header, offset + size)
        offset += size


def split_boxes(data: bytes) -> list[bytes]:
    """A whole file's top-level boxes, each as bytes; an incomplete tail is an error."""
    boxes = list(iter_boxes(data))
    end = boxes[-1].end if boxes else 0
    if end != len(data):
        raise ValueError(f"{len(data) - end} bytes after the last complete top-level box")
    return [data[b.start : b.end] for b in boxes]


# ---- top-level EBML elements (WebM): the Segment's children count as top-level, as the page reads them

EBML_NAMES = {
    0x1A45DFA3: "EBML",
    0x18538067: "Segment",
    0x114D9B74: "SeekHead",
    0x1549A966: "Info",
    0x1654AE6B: "Tracks",
    0x1F43B675: "Cluster",
    0x1C53BB6B: "Cues",
    0xEC: "Void",
}


def element_header(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[str, int, int] | None:
    """(name, header length, element size) of the EBML element at offset, or None while the header is
    incomplete. An element of unknown size (a live Segment) comes back with size -1."""
    if offset >= len(data):
        return None
    id_length = 9 - data[offset].bit_length()
    if not 1 <= id_length <= 4:
        raise ValueError(f"an EBML id of {id_length} bytes at offset {offset}")
    if len(data) - offset <= id_length:
        return None
    kind = int.from_bytes(data[offset : offset + id_length], "big")
    size_length = 9 - data[offset + id_length].bit_length()
    if not 1 <= size_length <= 8:
        raise ValueError(f"an EBML size of {size_length} bytes at offset {offset + id_length}")
    header = id_length + size_length
    if len(data) - offset < header:
        return None
    size = int.from_bytes(data[offset + id_length : offset + header], "big") & ((1 << (7 * size_length)) - 1)
    name = EBML_NAMES.get(kind, f"{kind:#x}")
    if size == (1 << (7 * size_length)) - 1:
        return name, header, -1
    return name, header, header + size


def iter_elements(data: bytes | bytearray | memoryview, offset: int = 0) -> Iterator[Box]:
    """The complete top-level elements in data from offset on: an element of unknown size comes as its header
    alone (its children follow as top-level elements); stops at an incomplete one."""
    while True:
        found = element_header(data, offset)
        if found is None:
            return
        kind, header, size = found
        end = offset + (header if size < 0 else size)
        if end > len(data):
            return
        yield Box(kind, offset, header, end)
        offset = end


def media_pieces(content_type: str | None) -> Callable[..., Iterator[Box]]:
    """iter_elements for a WebM stream, iter_boxes for an MP4 one."""
    return iter_elements if (content_type or "").startswith("video/webm") else iter_boxes


def avc1_codecs(init: bytes) -> str:
    """The RFC 6381 codec string ("avc1.PPCCLL") of the H.264 track in an init segment, from its avcC box."""
    at = init.find(b"avcC")
    if at < 4 or len(init) < at + 8:
        raise ValueError("no avcC box in the init segment")
    return "avc1." + init[at + 5 : at + 8].hex()


# ---- the page server


@dataclasses.dataclass
class RelayRecord:
    """What the relay did with the one stream it served (times: time.monotonic())."""

    content_type: str | None = None
    started_at: float | None = None
    boxes: list[str] = dataclasses.field(default_factory=list)  # top-level box types (webm: elements), in order
    held_at: float | None = None  # when the first fragment began to leave; the rest is held from then on
    held_bytes: int | None = None  # bytes relayed before the hold
    released_at: float | None = None
    released_by: str | None = None  # "buffered" (the page's report), "timeout", or "closing" (the server stopped)
    sent_bytes: int = 0
    finished_at: float | None = None  # the whole stream relayed, terminating chunk sent
    error: str | None = None  # the source failed (or the page went away); the response was cut off
    body: bytearray = dataclasses.field(default_factory=bytearray)  # everything relayed
    # set once finished_at or error is: a reader sees the terminating chunk before this thread stamps it
    ended: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)


class PageServer:
    """The page, the relay of the source's stream (GET /stream) and the page's reports (POST /report),
    on one origin at 127.0.0.1. A context manager: serves in a thread between enter and exit."""

    def __init__(self, source: Source, hold_timeout: float = 30.0):
        self.source = source
        self.hold_timeout = hold_timeout
        self.relay = RelayRecord()
        self.reports: list[dict[str, Any]] = []  # the page's reports in arrival order, each with "received_at"
        self._changed = threading.Condition()
        self._streams = 0
        self._closing = False
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def __enter__(self) -> "PageServer":
        self.port = free_port()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="browser-page-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()  # a relay still holding lets go
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # -- the page's reports

    def add_report(self, report: dict[str, Any]) -> None:
        report["received_at"] = time.monotonic()
        with self._changed:
            self.reports.append(report)
            self._changed.notify_all()

    def kinds(self) -> list[str]:
        with self._changed:
            return [r.get("kind", "?") for r in self.reports]

    def find(self, kind: str) -> dict[str, Any] | None:
        with self._changed:
            return next((r for r in self.reports if r.get("kind") == kind), None)

    def wait_for(
        self,
        kind: str,
        timeout: float = 30.0,
        fail_on: Iterable[str] = ("failure",),
        alive: Callable[[], bool] | None = None,
        describe: Callable[[], str] | None = None,
    ) -> dict[str, Any]:
        """The first report of this kind, waiting up to timeout seconds. AssertionError (with every report,
        the relay's record and describe()) on a timeout, on a report of a kind in fail_on, or once
        alive() says the browser is gone."""
        fail_on = set(fail_on) - {kind}
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for report in self.reports:
                    if report.get("kind") == kind:
                        return report
                    if report.get("kind") in fail_on:
                        raise AssertionError(
                            f"the page reported {report} while waiting for {kind!r}{self._context(describe)}"
                        )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {kind!r} report in {timeout} s{self._context(describe)}")
                if alive is not None and not alive():
                    raise AssertionError(f"the browser exited while waiting for {kind!r}{self._context(describe)}")
                self._changed.wait(min(left, 0.25))

    def _context(self, describe: Callable[[], str] | None) -> str:
        relay = dataclasses.replace(self.relay, body=bytearray())
        text = f"\nreports: {json.dumps(self.reports, indent=1)}\nrelay: {relay}"
        return text + ("\n" + describe() if describe else "")

    # -- the relay

    def _wait_buffered(self) -> str:
        deadline = time.monotonic() + self.hold_timeout
        with self._changed:
            while True:
                if any(r.get("kind") == "buffered" for r in self.reports):
                    return "buffered"
                if self._closing:
                    return "closing"
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                self._changed.wait(left)

    def _relay(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        record = self.relay
        record.started_at = time.monotonic()
        with contextlib.ExitStack() as stack:
            try:
                opened = self.source()
                if hasattr(opened, "__enter__"):
                    opened = stack.enter_context(opened)
                content_type, chunks = opened
                chunks = iter(chunks)
                if hasattr(chunks, "close"):
                    stack.callback(chunks.close)
            except Exception as e:
                record.error = f"the source failed to open: {e!r}"
                handler.send_error(502, record.error)
                record.ended.set()
                return
            record.content_type = content_type
            handler.send_response(200)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.send_header("Cache-Control", "no-store")
            handler.end_headers()

            def send(piece: bytes | bytearray) -> None:
                if piece:
                    handler.wfile.write(f"{len(piece):x}\r\n".encode() + bytes(piece) + b"\r\n")
                    handler.wfile.flush()
                    record.sent_bytes += len(piece)
                    record.body += piece

            received = bytearray()
            scanned = 0  # offset of the first top-level box not yet complete
            sent = 0
            held = False
            seen_moof = False
            pieces = media_pieces(content_type)
            try:
                for chunk in chunks:
                    received += chunk
                    hold_at = None
                    for box in pieces(received, scanned):
                        scanned = box.end
                        record.boxes.append(box.type)
                        seen_moof = seen_moof or box.type == "moof"
                        fragment_ends = box.type == "Cluster" or (seen_moof and box.type == "mdat")
                        if not held and hold_at is None and fragment_ends:
                            hold_at = box.end
                    if hold_at is not None:
                        held = True
                        # stamped before the send: the page may report the fragment buffered before
                        # send() returns to this thread
                        record.held_at, record.held_bytes = time.monotonic(), hold_at
                        send(received[sent:hold_at])
                        sent = hold_at
                        record.released_by = self._wait_buffered()
                        record.released_at = time.monotonic()
                    send(received[sent:])
                    sent = len(received)
                handler.wfile.write(b"0\r\n\r\n")
                handler.wfile.flush()
                record.finished_at = time.monotonic()
            except Exception as e:
                # cut the response off without its terminating chunk: the page sees a network error
                record.error = f"relaying failed after {record.sent_bytes} bytes: {e!r}"
                handler.close_connection = True
            finally:
                record.ended.set()


def _handler(server: PageServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):
            pass

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/":
                self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
            elif self.path == "/stream":
                with server._changed:
                    server._streams += 1
                    first = server._streams == 1
                if not first:
                    self._send(409, b"the stream is served once per page server", "text/plain")
                    return
                server._relay(self)
            else:
                self._send(404, b"not found", "text/plain")

        def do_POST(self):
            if self.path != "/report":
                self._send(404, b"not found", "text/plain")
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                report = json.loads(body)
                if not isinstance(report, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                report = {"kind": "failure", "message": f"unreadable report {body[:200]!r}: {e}"}
            server.add_report(report)
            self._send(204, b"", "text/plain")

    return Handler


# ---- the browser


class Chromium:
    """Headless Chromium on url, in a fresh profile; its output goes to a log file (log()). On exit it stops
    exactly the process group it started: SIGTERM, then SIGKILL after grace seconds."""

    def __init__(self, url: str, extra_flags: Iterable[str] = (), grace: float = 5.0):
        self.url = url
        self.extra_flags = tuple(extra_flags)
        self.grace = grace
        self.process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._log_text: str | None = None

    def __enter__(self) -> "Chromium":
        executable = require_chromium()
        self._dir = tempfile.mkdtemp(prefix="vae-chromium-")
        profile = os.path.join(self._dir, "profile")
        self.log_path = os.path.join(self._dir, "chromium.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *self.extra_flags, self.url],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() signals that group and nothing else
                env={**os.environ, "HOME": self._dir},  # nothing of the user's chromium state
            )
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        group = self.process.pid  # the group's leader: the group id is its pid
        try:
            if self.process.poll() is None:
                # the browser alone first: it shuts its own children down and reaps them (signalled together,
                # they'd exit as orphans of pid 1, which in a container may leave them zombies)
                self.process.send_signal(signal.SIGTERM)
                if not self._exited_unreaped(self.grace):
                    self._signal_group(group, signal.SIGKILL)
                    self._exited_unreaped(self.grace)
            # the leader exited but isn't reaped yet (when we waited for it here), so the group id is still
            # ours: kill what's left of the group (renderers, zygotes) before reaping it
            self._signal_group(group, signal.SIGKILL)
            # crashpad's handlers leave the group (their own sessions); they carry this instance's temp dir
            for pid in self._strays():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            self.process.wait(self.grace)
            self._log_text = self._read_log()
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def _exited_unreaped(self, timeout: float) -> bool:
        """Wait until the leader exits, leaving it a zombie (so its pid can't be reused)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                found = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # already reaped by Popen
                return True
            if found is not None:
                return True
            time.sleep(0.05)
        return False

    def _strays(self) -> list[int]:
        """Processes still running with this instance's (unique) temp dir in their command line."""
        marker = os.fsencode(self._dir or "") + b"/"
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                        found.append(int(entry))
        return found if self._dir else []

    @staticmethod
    def _signal_group(group: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)

    def _read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except (OSError, AttributeError):
            return ""

    def log(self, tail: int = 20000) -> str:
        text = self._log_text if self._log_text is not None else self._read_log()
        return text[-tail:]


@dataclasses.dataclass
class BrowserPage:
    server: PageServer
    browser: Chromium

    @property
    def relay(self) -> RelayRecord:
        return self.server.relay

    @property
    def reports(self) -> list[dict[str, Any]]:
        return self.server.reports

    def find(self, kind: str) -> dict[str, Any] | None:
        """The first report of this kind so far, or None."""
        return self.server.find(kind)

    def describe(self) -> str:
        return f"chromium log ({self.browser.log_path}):\n{self.browser.log()}"

    def wait_for(self, kind: str, timeout: float = 30.0, fail_on: Iterable[str] = ("failure",)) -> dict[str, Any]:
        return self.server.wait_for(kind, timeout, fail_on, alive=self.browser.alive, describe=self.describe)

    def explain(self) -> str:
        """Every report, the relay's record and Chromium's log: for assertion messages."""
        return self.server._context(self.describe)


@contextlib.contextmanager
def browser_page(source: Source, hold_timeout: float = 30.0, extra_flags: Iterable[str] = ()) -> Iterator[BrowserPage]:
    """A PageServer relaying source, and Chromium on its page."""
    with PageServer(source, hold_timeout) as server, Chromium(server.url, extra_flags) as browser:
        yield BrowserPage(server, browser)
