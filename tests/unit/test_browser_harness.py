"""The browser harness (tests/browser.py) on a fragmented MP4 made here with PyAV: headless Chromium
buffers the first fragment while the relayed response is still open, plays the clip to its end, and
reads the closing `vae-service:done` box; the relay holds after the first fragment until the page
says it buffered (or a timeout passes). Skipped without Chromium unless VAE_SERVICE_BROWSER_REQUIRED=1."""

import contextlib
import fractions
import io
import threading
import time

import av
import httpx
import numpy as np
import pytest

from tests.browser import (
    PageServer,
    avc1_codecs,
    box_header,
    browser_page,
    element_header,
    iter_boxes,
    iter_elements,
    require_chromium,
    split_boxes,
)
from vae_service_client.mp4 import DONE_TAG, ERROR_TAG, trailer

FRAMES, FPS = 9, 16


def fragmented_mp4(frames=FRAMES, fps=FPS, width=64, height=48, keyframe_every=3) -> bytes:
    """An H.264 fMP4 with a fragment at each (forced) keyframe, timescale = fps (a sample lasts 1), as the
    service's stream is made."""
    out = io.BytesIO()
    options = {"movflags": "frag_keyframe+empty_moov+default_base_moof", "video_track_timescale": str(fps)}
    with av.open(out, "w", format="mp4", options=options) as mp4:
        stream = mp4.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = keyframe_every
        stream.options = {"bf": "0", "sc_threshold": "0", "keyint_min": str(keyframe_every)}
        for i in range(frames):
            image = np.zeros((height, width, 3), np.uint8)
            image[..., 0] = 20 * i
            image[:, 6 * i : 6 * i + 6, 1] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = i, fractions.Fraction(1, fps)
            mp4.mux(stream.encode(frame))
        mp4.mux(stream.encode())
    return out.getvalue()


def closing_box(kind: str, summary: dict) -> bytes:
    """The service's last box (vae_service_client.mp4): `done` or `error` and its JSON."""
    return trailer(DONE_TAG if kind == "done" else ERROR_TAG, summary)


@pytest.fixture(scope="module")
def clip():
    """(content type, init segment, fragments): each fragment a moof+mdat pair."""
    boxes = split_boxes(fragmented_mp4())
    types = [box[4:8] for box in boxes]
    assert types[:2] == [b"ftyp", b"moov"], types
    init = b"".join(boxes[:2])
    media = [box for box in boxes[2:] if box[4:8] in (b"moof", b"mdat")]  # not the muxer's closing mfra
    fragments = [media[i] + media[i + 1] for i in range(0, len(media), 2)]
    assert [f[4:8] for f in fragments] == [b"moof"] * 3, [box[4:8] for box in media]
    return f'video/mp4; codecs="{avc1_codecs(init)}"', init, fragments


def paced(pieces, pause=0.05):
    for piece in pieces:
        yield piece
        time.sleep(pause)


def test_chromium_buffers_while_the_response_is_open_and_plays_to_the_end(clip):
    require_chromium()
    content_type, init, fragments = clip
    summary = {"frames": FRAMES, "fps": FPS}
    # the init in two pieces and a fragment split across reads: the page joins boxes across chunks
    last = fragments[-1]
    pieces = [init[:10], init[10:], *fragments[:-1], last[:50], last[50:], closing_box("done", summary)]

    @contextlib.contextmanager
    def source():
        yield content_type, paced(pieces)

    # the relay's own hold timeout out of reach: only the page's `buffered` report lets it go
    with browser_page(source, hold_timeout=3600.0) as page:
        kind = page.wait_for("type")
        assert kind["supported"] and kind["type"] == content_type, page.explain()
        buffered = page.wait_for("buffered")
        assert buffered["open"] and buffered["end"] > 0, page.explain()
        assert page.wait_for("done")["summary"] == summary
        ended = page.wait_for("ended")
        # the page reports in order: a failure made before `ended` was reported came in already
        assert page.find("failure") is None, page.explain()
        relay = page.relay

    duration = FRAMES / FPS
    assert abs(ended["duration"] - duration) <= 1 / FPS, page.explain()
    assert abs(ended["currentTime"] - duration) <= 1 / FPS, page.explain()
    assert ended["ranges"][0][0] <= 1 / FPS and abs(ended["ranges"][-1][1] - duration) <= 1 / FPS, page.explain()
    # the relay held right after the first fragment and let go on the page's `buffered` report
    assert relay.held_bytes == len(init) + len(fragments[0]), page.explain()
    assert relay.released_by == "buffered", page.explain()
    assert relay.released_at >= buffered["received_at"] >= relay.held_at, page.explain()
    assert bytes(relay.body) == b"".join(pieces) and relay.error is None
    assert relay.boxes == ["ftyp", "moov"] + ["moof", "mdat"] * len(fragments) + ["free"]


def test_the_page_reports_an_error_box(clip):
    require_chromium()
    content_type, init, fragments = clip
    summary = {"error": "decode failed", "frames": 1}

    def source():  # a plain (content type, chunks) pair also works as a source
        return content_type, iter([init, fragments[0], closing_box("error", summary)])

    with browser_page(source) as page:
        assert page.wait_for("error")["summary"] == summary
        stream_end = page.wait_for("stream_end")
        assert stream_end["marker"] == "error" and stream_end["boxes"][-1] == "free", page.explain()
        ended = page.wait_for("ended")
        assert abs(ended["duration"] - 3 / FPS) <= 1 / FPS, page.explain()


# ---- the relay without a browser: a client that reports by hand


def synthetic_stream() -> list[bytes]:
    """Box-shaped bytes (not playable): the first mdat has a 64-bit largesize header."""

    def box(kind: bytes, payload: bytes, large=False) -> bytes:
        if large:
            return (1).to_bytes(4, "big") + kind + (16 + len(payload)).to_bytes(8, "big") + payload
        return (8 + len(payload)).to_bytes(4, "big") + kind + payload

    boxes = [
        box(b"ftyp", b"iso5" * 3),
        box(b"moov", b"m" * 40),
        box(b"moof", b"f" * 30),
        box(b"mdat", b"d" * 300, large=True),
        box(b"moof", b"g" * 30),
        box(b"mdat", b"e" * 100),
        closing_box("done", {"frames": 2}),
    ]
    return boxes


def test_box_headers():
    large = (1).to_bytes(4, "big") + b"mdat" + (16 + 5).to_bytes(8, "big") + b"12345"
    assert box_header(large) == ("mdat", 16, 21)
    assert box_header(large[:12]) is None
    assert [b.type for b in iter_boxes(large + large[:20])] == ["mdat"]
    assert box_header((0).to_bytes(4, "big") + b"mdat") == ("mdat", 8, -1)
    with pytest.raises(ValueError):
        box_header((4).to_bytes(4, "big") + b"mdat")


def test_ebml_elements_as_the_relay_reads_a_webm_stream():
    from vae_service.engine.media.webm import ClusteredWebm
    from vae_service_client import webm

    writer = ClusteredWebm(16, 16, FPS)
    frames = np.zeros((3, 16, 16, 3), np.uint8)
    stream = writer.init_segment() + writer.fragment(frames[:1]) + writer.fragment(frames[1:])
    stream += webm.trailer(DONE_TAG, {"frames": 3})
    expected = ["EBML", "Segment", "Info", "Tracks", "Cluster", "Cluster", "Void"]
    assert [e.type for e in iter_elements(stream)] == expected
    assert [e.type for e in iter_elements(stream[:-1])] == expected[:-1]  # an incomplete one ends the scan
    assert element_header(stream[:1]) is None and element_header(bytes([0xEC, 0x81, 0])) == ("Void", 2, 3)
    with pytest.raises(ValueError):
        element_header(b"\x00\x81")


class Reader:
    """GET /stream in a thread, recording the bytes as they arrive."""

    def __init__(self, url: str):
        self.body = bytearray()
        self.done = threading.Event()
        self.headers = None
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url):
        try:
            with httpx.stream("GET", url + "stream", timeout=30) as response:
                self.headers = response.headers
                for chunk in response.iter_raw():
                    self.body += chunk
        finally:
            self.done.set()

    def wait_bytes(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.body) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.body) >= count, (len(self.body), count)


def test_the_relay_holds_after_the_first_fragment_until_the_page_reports_buffered():
    boxes = synthetic_stream()
    first = sum(len(b) for b in boxes[:4])
    # the whole stream in odd-sized chunks: the boundary falls inside one
    whole = b"".join(boxes)
    chunks = [whole[i : i + 37] for i in range(0, len(whole), 37)]

    with PageServer(lambda: ('video/mp4; codecs="avc1.64001f"', iter(chunks)), hold_timeout=20) as server:
        reader = Reader(server.url)
        reader.wait_bytes(first)
        time.sleep(0.5)
        assert len(reader.body) == first and not reader.done.is_set()
        assert reader.headers["content-type"] == 'video/mp4; codecs="avc1.64001f"'
        httpx.post(server.url + "report", json={"kind": "buffered", "open": True}).raise_for_status()
        assert reader.done.wait(10)
        assert bytes(reader.body) == whole
        assert server.relay.released_by == "buffered" and server.relay.held_bytes == first
        assert server.relay.ended.wait(5)
        assert server.relay.finished_at is not None and server.relay.error is None


def test_the_relay_lets_go_after_its_timeout():
    # the whole stream in one chunk: the relay holds after the first fragment in it, not the last
    whole = b"".join(synthetic_stream())
    first = sum(len(b) for b in synthetic_stream()[:4])
    with PageServer(lambda: ("video/mp4", [whole]), hold_timeout=0.3) as server:
        reader = Reader(server.url)
        assert reader.done.wait(10)
        assert bytes(reader.body) == whole
        assert server.relay.released_by == "timeout" and server.relay.held_bytes == first
        assert server.relay.released_at - server.relay.held_at >= 0.3
