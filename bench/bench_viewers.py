"""Viewers of a live decode session, on one running service (local Ray Serve, one replica of tiny-wan:
seeded random weights, it decodes noise; the timings do not depend on them). A denoiser sends one
chunk of `--latent-frames` latent frames every `--every-s` seconds (real time at the file's 16 fps by
default) over the WebSocket, the session opened with `output: mp4, watch: true`. Printed:

1. the denoiser's bytes received per chunk, `frames: "all"` vs `"none"` (the same chunks);
2. chunk sent -> its first frame shown in headless Chromium (the watch page, `requestVideoFrameCallback`:
   the time the page's presented-frame count first passes the frames before that chunk), by WebRTC
   (WHEP) and by MediaSource over WebSocket, p50 and p90 over the chunks;
3. 1, 4 and 16 viewers at once (MediaSource over WebSocket read by Python; WebRTC by aiortc in this
   process, which also decodes the VP8, on the same cores): the denoiser's chunk round trip p50 and
   each viewer's frame rate (min / median);
4. a stalled viewer (it joins and reads nothing: its socket's buffers fill, then its queue) beside 4
   healthy ones: their frame rate and the chunk round trip with and without it, and what it dropped.

Usage: python bench/bench_viewers.py [--quick] [--height 16 --width 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request

import msgpack
import numpy as np
from websockets.sync.client import connect

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import local_serve, print_table

from vae_service_client.messages import latents_map, pack

APP = "vae"


class Denoiser:
    """One session driven at a steady pace; per chunk: the send time (epoch ms), the frames before it,
    the round trip and the bytes received."""

    def __init__(self, url: str, args, **open_fields):
        self.args, self.ws = args, connect(url.replace("http://", "ws://") + "/sessions", max_size=None)
        self.ws.send(pack({"open": {"height": args.height, "width": args.width, "output": "mp4", **open_fields}}))
        self.opened = msgpack.unpackb(self.ws.recv(timeout=120), raw=False)["opened"]
        self.sent, self.before, self.trips, self.bytes = [], [], [], []
        self.frames = self.latent_frames = 0
        self.stop = threading.Event()

    def chunk(self, seed: int) -> None:
        z = np.random.default_rng(seed).standard_normal(
            (1, 4, self.args.latent_frames, self.args.height, self.args.width), dtype=np.float32
        )
        self.sent.append(time.time() * 1e3)
        self.before.append(self.frames)
        start, received = time.perf_counter(), 0
        self.ws.send(pack({"chunk": {"latents": latents_map(z), "latent_frame": self.latent_frames}}))
        while True:
            raw = self.ws.recv(timeout=120)
            received += len(raw)
            message = msgpack.unpackb(raw, raw=False)
            if "chunk_done" in message:
                break
        self.trips.append(time.perf_counter() - start)
        self.bytes.append(received)
        self.frames = message["chunk_done"]["frames"]
        self.latent_frames = message["chunk_done"]["latent_frames"]

    def run(self, chunks: int | None = None) -> None:
        seed = 0
        while not self.stop.is_set() and (chunks is None or seed < chunks):
            due = time.perf_counter() + self.args.every_s
            self.chunk(seed)
            seed += 1
            time.sleep(max(0.0, due - time.perf_counter()))

    def background(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.stop.set()
        self.ws.send(pack({"close": {}}))
        self.ws.recv(timeout=60)
        self.ws.close()


def bytes_per_chunk(url: str, args) -> list:
    rows = []
    for frames in ("all", "none"):
        denoiser = Denoiser(url, args, frames=frames)
        denoiser.run(args.chunks)
        denoiser.close()
        rows.append([frames, statistics.median(denoiser.bytes[1:]), statistics.median(denoiser.trips[1:]) * 1e3])
    rows[1].append(rows[0][1] / rows[1][1])
    rows[0].append("1 (all)")
    return rows


RECORDER = """(() => {
  const video = document.querySelector("video");
  window.shown = [];
  const record = (now, meta) => {
    window.shown.push([performance.timeOrigin + now, meta.presentedFrames]);
    video.requestVideoFrameCallback(record);
  };
  video.requestVideoFrameCallback(record);
  return true;
})()"""


def browser_latency(url: str, args, transport: str) -> list:
    from tests.watch_browser import chromium_tab

    denoiser = Denoiser(url, args, frames="none", watch=True)
    watch = denoiser.opened["watch"]
    page = f"{url}/watch/{watch['id']}?transport={transport}#token={watch['token']}"
    with chromium_tab(page) as tab:
        tab.wait_for("document.querySelector('video') !== null", 30)
        tab.evaluate(RECORDER)
        driving = denoiser.background()
        tab.wait_for("window.watchStats && window.watchStats.frames > 0", 60)
        time.sleep(args.seconds)
        denoiser.stop.set()
        driving.join()
        time.sleep(1.0)
        shown = tab.evaluate("window.shown")
        stats = tab.evaluate("window.watchStats")
    denoiser.close()
    # the page's first presented frame is the first frame of the first chunk sent after it joined
    first = next(i for i, sent in enumerate(denoiser.sent) if sent >= shown[0][0] - 5000) if shown else 0
    base = denoiser.before[first]
    latencies = []
    for sent, before in zip(denoiser.sent[first + 1 :], denoiser.before[first + 1 :], strict=True):
        count = before - base + 1  # the presented count once this chunk's first frame is shown
        when = next((t for t, n in shown if n >= count), None)
        if when is not None:
            latencies.append(when - sent)
    trip = statistics.median(denoiser.trips) * 1e3
    if not latencies:
        return [transport, stats.get("transport"), 0, "-", "-", trip, stats.get("frames")]
    latencies.sort()
    return [transport, stats.get("transport"), len(latencies), latencies[len(latencies) // 2],
            latencies[int(len(latencies) * 0.9)], trip, stats.get("frames")]  # fmt: skip


class StreamReader:
    """A MediaSource viewer read by Python: frames received and when."""

    def __init__(self, url: str, session: str, token: str):
        ws_url = url.replace("http://", "ws://") + f"/watch/{session}/stream"
        self.ws = connect(ws_url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None)
        self.frames, self.first, self.last, self.dropped = 0, None, None, 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            frame = None
            while True:
                message = self.ws.recv()
                if isinstance(message, str):
                    line = json.loads(message)
                    if line["type"] == "fragment":
                        now = time.perf_counter()
                        self.first = self.first or now
                        self.last, self.frames, self.dropped = now, self.frames + line["frames"], line["dropped"]
                        frame = line["frame"]
                    elif line["type"] == "ended":
                        return
                elif frame is not None:  # the fragment's bytes: acknowledged, as the watch page does
                    with contextlib.suppress(Exception):
                        self.ws.send(json.dumps({"ack": frame}))
        except Exception:
            return

    def fps(self) -> float:
        return 0.0 if self.first is None or self.last == self.first else self.frames / (self.last - self.first)


class WebRtcReader:
    """A WHEP viewer by aiortc, on a loop of its own: frames decoded and when."""

    def __init__(self, url: str, session: str, token: str):
        self.url, self.session, self.token = url, session, token
        self.frames, self.first, self.last = 0, None, None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._watch(),), daemon=True)
        self.thread.start()
        self.ready.wait(60)

    async def _watch(self) -> None:
        import httpx
        from aiortc import RTCPeerConnection, RTCSessionDescription

        pc = RTCPeerConnection()
        pc.addTransceiver("video", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(
                f"{self.url}/watch/{self.session}/whep",
                content=pc.localDescription.sdp.encode(),
                headers={"Content-Type": "application/sdp", "Authorization": f"Bearer {self.token}"},
            )
        await pc.setRemoteDescription(RTCSessionDescription(answer.text, "answer"))
        track = next(t.receiver.track for t in pc.getTransceivers())
        self.ready.set()
        try:
            while True:
                await asyncio.wait_for(track.recv(), 10)
                now = time.perf_counter()
                self.first = self.first or now
                self.last, self.frames = now, self.frames + 1
        except Exception:
            pass
        finally:
            await pc.close()

    def fps(self) -> float:
        return 0.0 if self.first is None or self.last == self.first else self.frames / (self.last - self.first)


def fan_out(url: str, args, counts: tuple[int, ...]) -> list:
    rows = []
    for kind, reader in (("MediaSource", StreamReader), ("WebRTC", WebRtcReader)):
        for count in counts:
            denoiser = Denoiser(url, args, frames="none", watch=True)
            watch = denoiser.opened["watch"]
            viewers = [reader(url, watch["id"], watch["token"]) for _ in range(count)]
            time.sleep(0.5)
            denoiser.run(args.chunks)
            denoiser.close()
            time.sleep(1.0)
            rates = sorted(v.fps() for v in viewers)
            rows.append([kind, count, statistics.median(denoiser.trips[1:]) * 1e3, rates[0], statistics.median(rates)])
    return rows


def stalled_socket(url: str, session: str, token: str) -> socket.socket:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    path = url.removeprefix("http://").split("/", 1)[1]
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((host, int(port)))
    stalled.sendall(
        (
            f"GET /{path}/watch/{session}/stream HTTP/1.1\r\nHost: {host}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {token}\r\n\r\n"
        ).encode()
    )
    return stalled


def with_a_stalled_viewer(url: str, args) -> list:
    rows = []
    for stalled_too in (False, True):
        denoiser = Denoiser(url, args, frames="none", watch=True)
        watch = denoiser.opened["watch"]
        healthy = [StreamReader(url, watch["id"], watch["token"]) for _ in range(4)]
        stalled = stalled_socket(url, watch["id"], watch["token"]) if stalled_too else None
        time.sleep(0.5)
        dropped_before = health(url)["viewers"]["fragments_dropped"]
        denoiser.run(args.stall_chunks)
        dropped = health(url)["viewers"]["fragments_dropped"] - dropped_before
        denoiser.close()
        if stalled is not None:
            stalled.close()
        rates = sorted(v.fps() for v in healthy)
        rows.append(["4 healthy" + (" + 1 stalled" if stalled_too else ""),
                     statistics.median(denoiser.trips[1:]) * 1e3, rates[0], statistics.median(rates),
                     sum(v.dropped for v in healthy), dropped])  # fmt: skip
    return rows


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        return json.load(answer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer chunks, 1 and 4 viewers")
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--latent-frames", type=int, default=1)
    parser.add_argument("--every-s", type=float, default=0.25, help="the denoiser's pace: a chunk every this long")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--stall-chunks", type=int, default=120)
    parser.add_argument("--seconds", type=float, default=10.0, help="browser: how long the session plays")
    args = parser.parse_args()
    counts = (1, 4, 16)
    if args.quick:
        args.chunks, args.stall_chunks, args.seconds, counts = 8, 16, 3.0, (1, 4)
    from ray import serve

    from vae_service.serving.app import decoder_app

    # room for 16 MediaSource viewers and the session beside the decode slots (each holds a connection)
    config = {"model": "tiny-wan", "model_name": "wan", "batching": {"max_batch_size": 8},
              "serving": {"concurrent_keys": 4}, "sessions": {"max_connections": 24}}  # fmt: skip
    with local_serve() as base:
        serve.run(decoder_app(config), name=APP, route_prefix=f"/{APP}")
        url = f"{base}/{APP}"
        size = f"{args.height}x{args.width} latents ({args.height * 8}x{args.width * 8} px)"
        print("# tiny-wan: seeded random weights, it decodes noise")
        print_table(
            f"The denoiser's bytes per chunk of {args.latent_frames} latent frame(s), {size}, mp4",
            ["frames", "bytes received (p50)", "round trip ms (p50)", "all / this"],
            bytes_per_chunk(url, args),
        )
        print_table(
            f"Chunk sent -> its first frame shown in Chromium, a chunk every {args.every_s:g} s (ms)",
            ["asked", "played by", "chunks", "p50", "p90", "the chunk's round trip (p50)", "frames shown"],
            [browser_latency(url, args, transport) for transport in ("webrtc", "mse")],
        )
        print_table(
            f"Viewers at once: the chunk round trip and each viewer's frames/s (the denoiser's pace: "
            f"{4 * args.latent_frames / args.every_s:g} frames/s)",
            ["viewers by", "viewers", "round trip ms (p50)", "fps (min)", "fps (median)"],
            fan_out(url, args, counts),
        )
        print_table(
            "A stalled viewer beside 4 healthy ones (MediaSource)",
            ["viewers", "round trip ms (p50)", "healthy fps (min)", "healthy fps (median)", "healthy dropped",
             "fragments dropped (all)"],
            with_a_stalled_viewer(url, args),
        )  # fmt: skip


if __name__ == "__main__":
    main()
