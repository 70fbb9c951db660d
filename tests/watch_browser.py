"""Headless Chromium driven over the DevTools protocol, for tests of pages that run on their own (the watch
page): evaluate JavaScript in the tab, wait for a condition, take a screenshot and read the pixels of an
element from it.

    with chromium_tab(url) as tab:
        tab.wait_for("window.watchStats.frames > 0", 20)
        pixels = frame_pixels(tab.screenshot(), video_rect(tab))

Chromium runs with tests/browser.py's flags in a fresh profile (tests/browser.py's Chromium, which stops
exactly the process group it started, also when the test fails), plus a DevTools port on loopback."""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image
from websockets.sync.client import ClientConnection, connect

from tests.browser import Chromium
from tests.ports import free_port


class PageError(AssertionError):
    """The page's JavaScript threw, or the tab did not answer."""


class Tab:
    """One page target of a Chromium, over its DevTools WebSocket. Not thread-safe."""

    def __init__(self, socket: ClientConnection, browser: Chromium):
        self.socket = socket
        self.browser = browser
        self.console: list[str] = []  # the page's console lines and the browser's log entries, as they came
        self._ids = itertools.count(1)

    def send(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        """One DevTools command and its result; events that come meanwhile are kept (console lines)."""
        call = next(self._ids)
        self.socket.send(json.dumps({"id": call, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PageError(f"{method}: no answer within {timeout_s} s\n{self.describe()}")
            try:
                message = json.loads(self.socket.recv(timeout=left))
            except TimeoutError:
                continue
            if message.get("id") == call:
                if "error" in message:
                    raise PageError(f"{method}: {message['error']}")
                return message.get("result", {})
            if message.get("method") == "Runtime.consoleAPICalled":
                args = message["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif message.get("method") == "Log.entryAdded":  # the browser's own: CSP violations, network errors
                entry = message["params"]["entry"]
                self.console.append(f"[{entry.get('source')} {entry.get('level')}] {entry.get('text')}")

    def evaluate(self, expression: str, timeout_s: float = 30.0) -> Any:
        """The expression's value in the page (JSON-able; a promise is awaited)."""
        result = self.send(
            "Runtime.evaluate",
            timeout_s,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(f"{expression!r} threw: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0, interval_s: float = 0.05) -> Any:
        """Polls the expression until it is truthy; its value. Fails with the page's console on a timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise PageError(f"{expression!r} still {value!r} after {timeout_s} s\n{self.describe()}")
            if not self.browser.alive():
                raise PageError(f"chromium exited while waiting for {expression!r}\n{self.describe()}")
            time.sleep(interval_s)

    def screenshot(self) -> bytes:
        """The viewport as a PNG, at the device's pixel ratio."""
        return base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])

    def describe(self) -> str:
        console = "\n".join(self.console[-50:])
        return f"page console:\n{console}\nchromium log:\n{self.browser.log(8000)}"


@dataclass(frozen=True)
class Rect:
    """CSS pixels of the viewport; `scale`: device pixels per CSS pixel."""

    x: float
    y: float
    width: float
    height: float
    scale: float = 1.0


def video_rect(tab: Tab, selector: str = "video", content: bool = True) -> Rect:
    """Where the video element is (getBoundingClientRect); content: only the picture in it, without the bars
    object-fit: contain leaves around a frame of another shape (the poster's, while it shows no video)."""
    found = tab.evaluate(
        f"""(async () => {{
            const v = document.querySelector({json.dumps(selector)});
            if (!v) return null;
            const r = v.getBoundingClientRect();
            let [w, h] = [v.videoWidth, v.videoHeight];
            if (!w && v.poster) {{
                const poster = new Image();
                poster.src = v.poster;
                await poster.decode();
                [w, h] = [poster.naturalWidth, poster.naturalHeight];
            }}
            return {{x: r.x, y: r.y, width: r.width, height: r.height, videoWidth: w, videoHeight: h,
                     scale: window.devicePixelRatio}};
        }})()"""
    )
    if found is None:
        raise PageError(f"no {selector} element in the page")
    x, y, width, height = found["x"], found["y"], found["width"], found["height"]
    if content and found["videoWidth"] and found["videoHeight"]:
        fit = min(width / found["videoWidth"], height / found["videoHeight"])
        shown_w, shown_h = found["videoWidth"] * fit, found["videoHeight"] * fit
        x, y, width, height = x + (width - shown_w) / 2, y + (height - shown_h) / 2, shown_w, shown_h
    return Rect(x, y, width, height, found["scale"] or 1.0)


def frame_pixels(png: bytes, rect: Rect, inset: int = 2) -> np.ndarray:
    """uint8 [H, W, 3]: the screenshot's pixels inside rect, less `inset` device pixels at each edge (where
    the scaled picture blends with what surrounds it)."""
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    left, top = round(rect.x * rect.scale) + inset, round(rect.y * rect.scale) + inset
    right = round((rect.x + rect.width) * rect.scale) - inset
    bottom = round((rect.y + rect.height) * rect.scale) - inset
    if not (0 <= left < right <= image.shape[1] and 0 <= top < bottom <= image.shape[0]):
        raise ValueError(f"{rect} is not inside the {image.shape[1]}x{image.shape[0]} screenshot")
    return image[top:bottom, left:right]


def _page_target(port: int, browser: Chromium, timeout_s: float) -> str:
    """The DevTools WebSocket URL of the browser's first page, once its endpoint answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2) as response:
                targets = json.load(response)
            pages = [t for t in targets if t.get("type") == "page" and "webSocketDebuggerUrl" in t]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        if not browser.alive():
            raise PageError(f"chromium exited before its DevTools endpoint answered\n{browser.log(8000)}")
        if time.monotonic() > deadline:
            raise PageError(f"no DevTools page target within {timeout_s} s\n{browser.log(8000)}")
        time.sleep(0.1)


@contextlib.contextmanager
def chromium_tab(url: str, start_timeout_s: float = 30.0, window: tuple[int, int] = (800, 600)) -> Iterator[Tab]:
    """Chromium on about:blank, then url loaded in its tab (so the page's console is caught from its start)."""
    port = free_port()
    flags = (
        f"--remote-debugging-port={port}",
        "--remote-debugging-address=127.0.0.1",
        f"--window-size={window[0]},{window[1]}",
    )
    with Chromium("about:blank", flags) as browser:
        target = _page_target(port, browser, start_timeout_s)
        # DevTools' messages (a screenshot) can be several MB
        with connect(target, max_size=None, open_timeout=start_timeout_s) as socket:
            tab = Tab(socket, browser)
            tab.send("Runtime.enable")
            tab.send("Page.enable")
            tab.send("Log.enable")
            tab.send("Page.navigate", url=url)
            tab.wait_for("location.href !== 'about:blank' && document.readyState === 'complete'", start_timeout_s)
            yield tab
