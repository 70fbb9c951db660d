"""A real browser plays the service's streamed mp4 and webm: headless Chromium feeds `POST /decode`
with `stream: true, output: "mp4"` (`"webm"`) into a <video> element through Media Source
Extensions (tests/browser.py, tests/browser_page.html), buffers frames while the answer is still
open (the page's relay holds the rest of the answer after the first fragment, webm's first Cluster,
until the browser says so), and plays to the clip's duration; and the watch page plays a live
session by WebRTC and by MediaSource."""

import contextlib
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
import torch
from websockets.sync.client import connect

from tests.browser import avc1_codecs, browser_page, iter_elements, require_chromium, split_boxes
from tests.session_wire import ws_url
from tests.watch_browser import chromium_tab, frame_pixels, video_rect
from vae_service.config import Encoding
from vae_service_client.messages import MSGPACK, latents_map, pack, request_map
from vae_service_client.mp4 import stream_reader

pytestmark = pytest.mark.integration
FPS = Encoding().mp4_fps  # the wan app's default


@pytest.mark.parametrize("quality, output", [("lossless", "mp4"), ("high", "mp4"), ("high", "webm")])
def test_chromium_buffers_the_stream_while_it_is_open_and_plays_it_to_the_end(wan_url, quality, output):
    require_chromium()
    latent_frames = 4
    z = torch.randn(1, 4, latent_frames, 4, 6, generator=torch.Generator().manual_seed(7))
    frames = 1 + 4 * (latent_frames - 1)
    body = pack(request_map(z, quality, output, stream=True, request_id="browser"))

    @contextlib.contextmanager
    def source():
        headers = {"content-type": MSGPACK}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{wan_url}/decode", content=body, headers=headers) as r,
        ):
            assert r.status_code == 200, r.read()
            yield r.headers["content-type"], r.iter_raw()

    with browser_page(source) as page:
        assert page.wait_for("type")["supported"], page.explain()
        buffered = page.wait_for("buffered", timeout=60)
        done = page.wait_for("done", timeout=60)["summary"]
        ended = page.wait_for("ended", timeout=60)
        assert page.find("failure") is None, page.explain()
        relay = page.relay
    assert buffered["open"], page.explain()  # frames in the element before the answer was over
    assert relay.held_at <= buffered["received_at"] <= relay.released_at, page.explain()
    assert abs(ended["duration"] - frames / FPS) < 0.5 / FPS, page.explain()
    assert abs(ended["currentTime"] - ended["duration"]) < 0.5 / FPS, page.explain()
    assert (done["request_id"], done["quality"]) == ("browser", quality)
    # what the browser got: the init segment and one fragment per latent frame, as the header says
    reader = stream_reader(output)
    media = reader.feed(bytes(relay.body))
    assert reader.close()["request_id"] == "browser"
    if output == "webm":
        elements = [e.type for e in iter_elements(media)]
        assert elements == ["EBML", "Segment", "Info", "Tracks"] + ["Cluster"] * latent_frames
        assert relay.boxes == [*elements, "Void"] and relay.content_type == 'video/webm; codecs="vp9"'
        return
    assert len(split_boxes(media)) == 2 + 2 * latent_frames
    assert relay.content_type == f'video/mp4; codecs="{avc1_codecs(media)}"'


@pytest.mark.parametrize("transport", ["webrtc", "mse"])
def test_chromium_watches_a_live_session_whose_denoiser_gets_only_chunk_done(wan_url, transport):
    """The watch page (its token in the URL's fragment) plays a session live by WHEP and by
    MediaSource while the denoiser, which asked `frames: none`, sends chunks; a screenshot shows the
    decoded frames; the session's close ends the page's stream."""
    require_chromium()
    with connect(ws_url(wan_url), max_size=None) as ws:
        ws.send(pack({"open": {"height": 8, "width": 12, "output": "mp4", "frames": "none", "watch": True}}))
        watch = msgpack.unpackb(ws.recv(timeout=60), raw=False)["opened"]["watch"]
        page = f"{wan_url}{watch['url'].replace('#', f'?transport={transport}#', 1)}"
        answers, stop = [], threading.Event()

        def denoiser():
            at = 0
            while not stop.is_set():
                z = np.random.default_rng(at).standard_normal((1, 4, 1, 8, 12), dtype=np.float32)
                ws.send(pack({"chunk": {"latents": latents_map(z), "latent_frame": at}}))
                answers.append(msgpack.unpackb(ws.recv(timeout=60), raw=False))
                at += 1
                time.sleep(0.2)

        with chromium_tab(page) as tab:
            driving = threading.Thread(target=denoiser, daemon=True)
            driving.start()
            try:
                tab.wait_for("window.watchStats && window.watchStats.frames >= 8", 90)
                stats = tab.evaluate("window.watchStats")
                pixels = frame_pixels(tab.screenshot(), video_rect(tab))
            finally:
                stop.set()
                driving.join(60)
            ws.send(pack({"close": {}}))
            closed = msgpack.unpackb(ws.recv(timeout=60), raw=False)
            if transport == "mse":  # a WebRTC track has no end of stream the page is told of
                tab.wait_for("window.watchStats.state === 'ended'", 30)
    assert stats["transport"] == transport and stats["error"] is None, stats
    assert all(list(answer) == ["chunk_done"] for answer in answers)  # no frame message ever came back
    assert "closed" in closed
    # the decoded noise, not a black or uniform box: bright enough, and varied across the element
    assert pixels.mean() > 20 and pixels.std() > 10, (pixels.mean(), pixels.std())
