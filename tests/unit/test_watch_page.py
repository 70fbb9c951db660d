"""The watch page (serving/viewers/watch_page.py): its bytes and headers, and headless Chromium running it
against a small server in the test that speaks the viewers' MediaSource protocol with a real fragmented MP4
from the service's own writer. Chromium's part is skipped without Chromium (tests/browser.py's
require_chromium: failed instead where VAE_SERVICE_BROWSER_REQUIRED=1)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import html.parser
import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.browser import require_chromium
from tests.ports import free_port
from tests.watch_browser import Tab, chromium_tab, frame_pixels, video_rect
from vae_service.engine.media.encoding import EncodeSettings, video_writer
from vae_service.serving.viewers.watch_page import PAGE, PAGE_HEADERS

# 4 fps: the 12 frames last 3 s, twice the page's reach behind the newest frame (LIVE_MAX_S, 1.5 s)
WIDTH, HEIGHT, FRAMES, FPS = 96, 64, 12, 4
FRAGMENT = 3  # frames per fragment: 4 fragments, each starting with a keyframe
LIVE_MAX_FRAMES = 6  # the page's LIVE_MAX_S at FPS
TRIM_AFTER_S = 20  # the page's: buffered media behind the playhead it lets pile up
# the clip is a long session's, 100 s in: its times start there, and the page must find them (not wait at 0)
SESSION_FRAMES = 100 * FPS

CSP_TEMPLATE = (
    "default-src 'none'; script-src 'sha256-{script}'; style-src 'sha256-{style}'; connect-src 'self' ws: wss:; "
    "media-src 'self' blob:; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def gradient(t: int) -> np.ndarray:
    """Frame t: red a sine across the width that moves a twelfth of its period a frame, green down the height,
    blue across the width; smooth, so H.264 keeps it close."""
    x = np.arange(WIDTH)[None, :] / WIDTH
    y = np.arange(HEIGHT)[:, None] / HEIGHT
    red = 128 + 100 * np.sin(2 * np.pi * (x + t / FRAMES)) + 0 * y
    green = 40 + 170 * y + 0 * x
    blue = 60 + 120 * (1 - x) + 0 * y
    return np.stack([red, green, blue], axis=-1).round().astype(np.uint8)


@pytest.fixture(scope="module")
def clip() -> tuple[str, bytes, list[bytes], np.ndarray]:
    """(content type, init segment, fragments, the frames) of the gradient, by the service's mp4 writer."""
    frames = np.stack([gradient(t) for t in range(FRAMES)])
    writer = video_writer("mp4", WIDTH, HEIGHT, EncodeSettings(mp4_fps=FPS))
    try:
        init = writer.init_segment()
        writer.resume(SESSION_FRAMES, SESSION_FRAMES // FRAGMENT)
        fragments = [writer.fragment(frames[i : i + FRAGMENT]) for i in range(0, FRAMES, FRAGMENT)]
        content_type = f'video/mp4; codecs="{writer.codecs}"'
    finally:
        writer.close()
    return content_type, init, fragments, frames


# ---- the page's bytes and headers


class Elements(html.parser.HTMLParser):
    """Every start tag's attributes, and the text of each script and style element."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.texts: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in self.texts:
            self._open = tag
            self.texts[tag].append("")

    def handle_endtag(self, tag):
        if tag == self._open:
            self._open = None

    def handle_data(self, data):
        if self._open:
            self.texts[self._open][-1] += data


def parsed() -> Elements:
    elements = Elements()
    elements.feed(PAGE.decode("utf-8"))
    elements.close()
    return elements


def sha256_b64(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def test_headers_are_the_contracts_with_the_inline_scripts_and_styles_hashes():
    elements = parsed()
    assert len(elements.texts["script"]) == 1, "one inline script: the CSP allows that one by its hash"
    assert len(elements.texts["style"]) == 1
    script, style = elements.texts["script"][0], elements.texts["style"][0]
    assert "watchStats" in script and "video" in style  # the real elements, not empty ones
    contract = {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": CSP_TEMPLATE.format(script=sha256_b64(script), style=sha256_b64(style)),
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    }
    assert contract == PAGE_HEADERS


def test_the_page_has_no_inline_handlers_external_urls_or_sources():
    elements = parsed()
    for tag, attrs in elements.tags:
        handlers = [name for name in attrs if name.startswith("on")]
        assert not handlers, f"<{tag}> has inline handlers {handlers}: the CSP blocks them"
        assert "style" not in attrs, f"<{tag}> has a style attribute: the CSP blocks it"
        for name in ("src", "href", "action", "poster", "srcset"):
            value = attrs.get(name)
            assert value is None or value.startswith("data:"), f"<{tag} {name}={value!r}> loads something"
    text = PAGE.decode("utf-8")
    assert not re.search(r"(?i)\b(?:https?|wss?|ftp):/", text), "an absolute URL in the page"
    assert not re.search(r"""["'`]//\w""", text), "a scheme-relative URL in the page"
    assert text.isascii()


def test_the_page_is_the_same_for_every_session(clip):
    with TestClient(viewer_app(Replica("one", "t" * 43, clip))) as client:
        pages = [client.get(f"/watch/{session}") for session in ("one", "another-session", "x" * 64)]
    for page in pages:
        assert page.status_code == 200
        assert page.content == PAGE
        assert {k: page.headers[k] for k in PAGE_HEADERS} == PAGE_HEADERS
    assert b"another-session" not in PAGE


# ---- a viewer's server: the page, a stream speaking the MediaSource protocol, and (webrtc) WHEP by aiortc


@dataclass
class Replica:
    """One watched session: its id and token, the fragments it streams. Connection n (from 0) of the stream
    sends `batches[n]` (fragment indices: one skipped counts as dropped for this viewer; one repeated goes on
    in sequence, as the session's later frames would), then waits for
    `release[n]` and ends with `endings[n]`. With `webrtc`, POST .../whep answers with an aiortc peer sending
    the gradient; otherwise 404 there."""

    session: str
    token: str
    clip: tuple[str, bytes, list[bytes], np.ndarray]
    batches: list[list[int]] = field(default_factory=lambda: [[0, 1, 2, 3]])
    endings: list[str] = field(default_factory=lambda: ["closed"])
    webrtc: bool = False
    requests: list[dict] = field(default_factory=list)  # every HTTP request and WebSocket handshake
    tokens: list[str | None] = field(default_factory=list)  # each stream's first message's token
    closes: list[int] = field(default_factory=list)  # the close code each stream ended with
    served: list[threading.Event] = field(default_factory=list)  # set once connection n sent its batch
    release: list[threading.Event] = field(default_factory=list)
    peers: dict = field(default_factory=dict)  # WHEP resource -> its RTCPeerConnection
    deleted: list[str] = field(default_factory=list)  # WHEP resources the page deleted
    over: bool = False  # the session ended: WHEP refuses offers
    loop: asyncio.AbstractEventLoop | None = None

    def __post_init__(self):
        self.served = [threading.Event() for _ in self.batches]
        self.release = [threading.Event() for _ in self.batches]

    def request_texts(self) -> list[str]:
        """Each request's line and headers, as text."""
        return [
            f"{r['method']} {r['path']}?{r['query']}\n" + "\n".join(f"{k}: {v}" for k, v in r["headers"])
            for r in self.requests
        ]

    def end_webrtc(self) -> None:
        """The session ends: every peer connection closes (DTLS close_notify), and new offers are refused."""
        self.over = True
        assert self.loop is not None
        for peer in list(self.peers.values()):
            asyncio.run_coroutine_threadsafe(peer.close(), self.loop).result(10)


def gradient_track():
    """An aiortc video track sending the gradient's frames over and over at aiortc's 30 fps."""
    from aiortc import VideoStreamTrack
    from av import VideoFrame

    class Gradient(VideoStreamTrack):
        sent = 0

        async def recv(self):
            pts, time_base = await self.next_timestamp()
            frame = VideoFrame.from_ndarray(gradient(self.sent % FRAMES), format="rgb24")
            frame.pts, frame.time_base = pts, time_base
            self.sent += 1
            return frame

    return Gradient()


def viewer_app(replica: Replica) -> Starlette:
    content_type, init, fragments, _ = replica.clip

    def authorized(request) -> bool:
        return request.headers.get("authorization") == f"Bearer {replica.token}" and not replica.over

    async def page(request):
        return Response(PAGE, headers=PAGE_HEADERS)

    async def whep(request):
        if not replica.webrtc:
            return Response("no WebRTC here", 404)
        if not authorized(request) or request.path_params["session"] != replica.session:
            return Response("unauthorized", 401)
        if request.headers.get("content-type") != "application/sdp":
            return Response("Content-Type must be application/sdp", 415)
        from aiortc import RTCPeerConnection, RTCSessionDescription

        peer = RTCPeerConnection()
        await peer.setRemoteDescription(RTCSessionDescription((await request.body()).decode(), "offer"))
        peer.addTrack(gradient_track())
        await peer.setLocalDescription(await peer.createAnswer())
        resource = secrets.token_hex(8)
        replica.peers[resource] = peer
        location = f"/watch/{replica.session}/whep/{resource}"
        return Response(peer.localDescription.sdp, 201, headers={"Location": location}, media_type="application/sdp")

    async def whep_resource(request):
        if request.headers.get("authorization") != f"Bearer {replica.token}":
            return Response("unauthorized", 401)
        resource = request.path_params["resource"]
        replica.deleted.append(resource)
        peer = replica.peers.pop(resource, None)
        if peer is not None:
            await peer.close()
        return Response("", 200)

    async def stream(ws: WebSocket):
        await ws.accept()
        connection = len(replica.tokens)
        try:
            first = json.loads(await asyncio.wait_for(ws.receive_text(), 10))
            token = first.get("token") if isinstance(first, dict) else None
        except (TimeoutError, ValueError, WebSocketDisconnect):
            token = None
        replica.tokens.append(token)
        if token != replica.token or ws.path_params["session"] != replica.session:
            replica.closes.append(4401)
            await ws.close(4401, "unauthorized")
            return
        batch = replica.batches[connection]
        first = SESSION_FRAMES + batch[0] * FRAGMENT
        await ws.send_text(json.dumps({"type": "start", "content_type": content_type, "frame": first}))
        await ws.send_bytes(init)
        dropped = 0
        for position, index in enumerate(batch):
            start = SESSION_FRAMES + index * FRAGMENT
            dropped += max(0, index - batch[position - 1] - 1) if position else 0
            message = {"type": "fragment", "frame": start, "frames": FRAGMENT, "chunk_ms": int(time.time() * 1000)}
            await ws.send_text(json.dumps({**message, "dropped": dropped}))
            await ws.send_bytes(fragments[index])
        replica.served[connection].set()
        await asyncio.to_thread(replica.release[connection].wait, 60)
        ended = {"type": "ended", "reason": replica.endings[connection], "frames": len(batch) * FRAGMENT}
        await ws.send_text(json.dumps(ended))
        replica.closes.append(1000)
        await ws.close(1000)

    async def logged(scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            replica.requests.append(
                {
                    "method": scope.get("method", "GET"),
                    "path": scope.get("raw_path", scope["path"].encode()).decode("latin-1"),
                    "query": scope["query_string"].decode("latin-1"),
                    "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]],
                }
            )
        await app(scope, receive, send)

    app = Starlette(
        routes=[
            Route("/watch/{session}", page),
            WebSocketRoute("/watch/{session}/stream", stream),
            Route("/watch/{session}/whep", whep, methods=["POST"]),
            Route("/watch/{session}/whep/{resource}", whep_resource, methods=["DELETE"]),
        ],
    )
    return logged


@contextlib.contextmanager
def serving(replica: Replica) -> Iterator[str]:
    """The replica's app on loopback in a thread: its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(viewer_app(replica), "127.0.0.1", port, log_level="warning"))
    replica.loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=replica.loop.run_until_complete, args=(server.serve(),), name="watch-page-server", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for event in replica.release:
            event.set()
        for peer in list(replica.peers.values()):
            asyncio.run_coroutine_threadsafe(peer.close(), replica.loop).result(10)
        server.should_exit = True
        thread.join(30)
        replica.loop.close()


# ---- what the browser shows


def stats(tab: Tab) -> dict:
    """window.watchStats and the page's text of it, read at once."""
    return tab.evaluate(
        """({stats: Object.assign({}, window.watchStats),
             shown: Object.fromEntries(["frames", "latency", "transport", "state"].map(
               (id) => [id, document.getElementById(id).textContent]))})"""
    )


def shown_frame(tab: Tab) -> np.ndarray:
    """The video's picture in a screenshot, scaled back to the clip's size."""
    pixels = frame_pixels(tab.screenshot(), video_rect(tab))
    image = Image.fromarray(pixels).resize((WIDTH, HEIGHT), Image.Resampling.BOX)
    return np.asarray(image).astype(np.float32)


def closest(picture: np.ndarray, frames: np.ndarray) -> tuple[int, list[float]]:
    """The frame the picture is closest to, and its mean absolute difference to each frame."""
    errors = [float(np.abs(picture - frame.astype(np.float32)).mean()) for frame in frames]
    return int(np.argmin(errors)), errors


def assert_shows_frames(picture: np.ndarray, frames: np.ndarray, among: range, context: str) -> int:
    """The picture is decoded video, not black or blank, and it is one of the frames in `among`."""
    assert picture.mean() > 60 and picture.std() > 25, f"no picture: mean {picture.mean()}, std {picture.std()}"
    best, errors = closest(picture, frames)
    # neighbouring frames differ by ~12 per pixel on average (the moving sine); the codec and scaling by ~2
    assert best in among and errors[best] < 6, f"closest frame {best}, errors {errors}\n{context}"
    return best


def wait_for_frame(tab: Tab, frames: np.ndarray, index: int, timeout_s: float) -> None:
    """Until the video shows frame `index` (screenshots, as the compositor catches up with playback)."""
    deadline = time.monotonic() + timeout_s
    while True:
        picture = shown_frame(tab)
        best, errors = closest(picture, frames)
        if best == index and errors[best] < 6:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"frame {index} never shown: last {best}, errors {errors}\n{tab.describe()}")
        time.sleep(0.1)


def assert_token_unseen(replica: Replica, token: str) -> None:
    texts = replica.request_texts()
    assert texts, "the server logged no requests"
    leaks = [text for text in texts if token in text]
    assert not leaks, f"the token went to the server in a request line or header: {leaks}"


def test_chromium_plays_the_stream_over_mediasource_and_follows_a_move(clip):
    require_chromium()
    frames = clip[3]
    token = secrets.token_urlsafe(32)
    # the session moves after the first fragment: the page reconnects and goes on from the second; there the
    # third is dropped (a slow viewer), and the fourth must follow the second without a gap
    replica = Replica("s-1", token, clip, batches=[[0], [1, 3]], endings=["moved", "closed"])
    with serving(replica) as url, chromium_tab(f"{url}/watch/s-1?transport=mse#token={token}") as tab:
        assert replica.served[0].wait(30), tab.describe()
        tab.wait_for("window.watchStats.frames > 0 && window.watchStats.state === 'playing'", 30)
        assert_shows_frames(shown_frame(tab), frames, range(0, FRAGMENT), tab.describe())
        now = stats(tab)
        assert now["stats"]["transport"] == "mse" and now["stats"]["error"] is None
        assert now["shown"]["transport"] == "mse" and now["shown"]["state"] == "playing"
        # the display latency: from the fragment's chunk_ms (this machine's clock) to its frame on screen
        assert 0 <= now["stats"]["latency_ms"] < 10_000, now
        assert now["shown"]["latency"] == f"{round(now['stats']['latency_ms'])} ms"
        first_frames = tab.evaluate("window.watchStats.frames")

        replica.release[0].set()  # "moved"
        assert replica.served[1].wait(30), tab.describe()
        replica.release[1].set()  # "closed"
        tab.wait_for("window.watchStats.state === 'ended'", 30)
        # the frames after the move are shown too, up to the last, which stays on screen
        wait_for_frame(tab, frames, FRAMES - 1, 30)
        time.sleep(0.5)
        assert_shows_frames(shown_frame(tab), frames, range(FRAMES - 1, FRAMES), tab.describe())
        end = stats(tab)
        assert end["stats"]["frames"] > first_frames, (first_frames, end)
        assert end["shown"]["frames"] == str(end["stats"]["frames"]) and end["shown"]["state"] == "ended"
        assert end["stats"]["error"] is None and end["stats"]["dropped"] == 1, end
        violations = [line for line in tab.console if "Content Security Policy" in line]
        assert not violations, violations
    assert replica.tokens == [token, token]
    assert replica.closes == [1000, 1000]
    assert_token_unseen(replica, token)


def test_a_wrong_token_fails_the_page_and_never_travels_in_a_request(clip):
    require_chromium()
    token, wrong = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    replica = Replica("s-2", token, clip)
    with serving(replica) as url, chromium_tab(f"{url}/watch/s-2?transport=mse#token={wrong}") as tab:
        tab.wait_for("window.watchStats.state === 'failed'", 30)
        end = stats(tab)
        assert end["stats"]["error"] == "unauthorized" and end["stats"]["frames"] == 0, end
        assert end["shown"]["state"] == "failed"
        time.sleep(1)  # a page that wrongly retried would connect again meanwhile
    assert replica.tokens == [wrong]
    assert replica.closes == [4401]
    assert_token_unseen(replica, wrong)
    assert_token_unseen(replica, token)


def test_without_webrtc_the_page_falls_back_to_mediasource_near_the_live_edge(clip):
    require_chromium()
    token = secrets.token_urlsafe(32)
    # POST .../whep: 404. 30 s of the stream come at once (the clip ten times over): the page plays near the
    # newest frame, not from the first, and keeps no more than TRIM_AFTER_S behind the playhead
    replica = Replica("s-3", token, clip, batches=[list(range(FRAMES // FRAGMENT)) * 10])
    with serving(replica) as url, chromium_tab(f"{url}/watch/s-3#token={token}") as tab:
        tab.wait_for("window.watchStats.transport === 'mse' && window.watchStats.frames > 0", 30)
        # "sequence" mode places the first fragment at 0 and each after the one before
        everything = f"(b => b.length && b.end(b.length - 1) > {10 * FRAMES / FPS - 0.01})"
        tab.wait_for(everything + "(document.querySelector('video').buffered)")
        start, end, now = tab.evaluate(
            "(v => [v.buffered.start(0), v.buffered.end(v.buffered.length - 1), v.currentTime])"
            "(document.querySelector('video'))"
        )
        assert end - now < LIVE_MAX_FRAMES / FPS + 0.5, (start, end, now)
        assert start > 0 and now - start <= TRIM_AFTER_S + FRAGMENT / FPS, (start, end, now)
        # it plays on to the newest frame and stays there (the picture catches up with the jumps in a moment)
        wait_for_frame(tab, clip[3], FRAMES - 1, 5)
    offers = [r for r in replica.requests if r["method"] == "POST"]
    assert [r["path"] for r in offers] == ["/watch/s-3/whep"], replica.requests
    assert dict(offers[0]["headers"])["authorization"] == f"Bearer {token}"
    assert dict(offers[0]["headers"])["content-type"] == "application/sdp"
    assert replica.tokens == [token]
    # the WHEP offer's Authorization header was the only place the token went in a request
    replica.requests.remove(offers[0])
    assert_token_unseen(replica, token)


def test_chromium_plays_webrtc_by_whep_and_ends_with_the_last_frame_shown(clip):
    pytest.importorskip("aiortc")
    require_chromium()
    frames = clip[3]
    token = secrets.token_urlsafe(32)
    replica = Replica("s-4", token, clip, webrtc=True)
    with serving(replica) as url, chromium_tab(f"{url}/watch/s-4#token={token}") as tab:
        tab.wait_for("window.watchStats.state === 'playing' && window.watchStats.latency_ms !== null", 30)
        now = stats(tab)
        assert now["stats"]["transport"] == "webrtc" and now["shown"]["transport"] == "webrtc", now
        assert 0 <= now["stats"]["latency_ms"] < 5_000, now  # the receive side's jitter buffer delay
        assert_shows_frames(shown_frame(tab), frames, range(FRAMES), tab.describe())
        (resource,) = replica.peers

        # the page sees the DTLS close at once (ICE would take ~20 s more) and offers again: refused each
        # time (a session that moved is refused until its denoiser attaches: asked 4 times, 5 s), it ends
        replica.end_webrtc()
        tab.wait_for("window.watchStats.state === 'ended'", 20)
        end = stats(tab)
        assert end["stats"]["frames"] >= now["stats"]["frames"] > 0 and end["stats"]["error"] is None, end
        # the last frame stays on screen (the video's poster, sized as the video was)
        assert tab.evaluate("document.querySelector('video').poster").startswith("data:image/png")
        assert_shows_frames(shown_frame(tab), frames, range(FRAMES), tab.describe())
    assert replica.deleted == [resource]
    assert replica.tokens == []  # no MediaSource fallback
    offers = [r for r in replica.requests if r["method"] in ("POST", "DELETE")]
    assert [r["method"] for r in offers] == ["POST", "DELETE", "POST", "POST", "POST", "POST"], replica.requests
    for request in offers:
        assert dict(request["headers"])["authorization"] == f"Bearer {token}"
        replica.requests.remove(request)
    assert_token_unseen(replica, token)
