"""Viewers' and denoisers' side of a watched session as the tests speak it: raw WebSocket clients
(the `websockets` library) sending the documented messages, at a service's base URL (the replica's
routes under uvicorn, tests/watch_server.py, or a Serve application)."""

from __future__ import annotations

import contextlib
import json
import threading

import msgpack
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from vae_service_client.messages import pack


def ws_of(url: str, path: str, **options):
    return connect(url.replace("http://", "ws://", 1) + path, max_size=None, **options)


def say(ws, kind: str, fields: dict) -> dict:
    ws.send(pack({kind: fields}))
    return msgpack.unpackb(ws.recv(timeout=60), raw=False)


def replies_until_done(ws) -> list[dict]:
    out = []
    while True:
        out.append(msgpack.unpackb(ws.recv(timeout=60), raw=False))
        if "chunk_done" in out[-1] or "error" in out[-1]:
            return out


def open_session(url: str, **fields):
    """A session of the tiny Wan decoder's 6x10 latents, mp4 (fields on top): (its socket, opened)."""
    ws = ws_of(url, "/sessions")
    opened = say(ws, "open", {"height": 6, "width": 10, "output": "mp4", **fields})
    return ws, opened


class StreamViewer:
    """A MediaSource viewer's side of /watch/<id>/stream, as the page speaks it; `headers` on the
    handshake (Serve's proxy routes by `x-session-id`)."""

    def __init__(self, url: str, session: str, token: str | None, in_header: bool = True, **headers: str):
        if in_header and token:
            headers["Authorization"] = f"Bearer {token}"
        self.ws = ws_of(url, f"/watch/{session}/stream", additional_headers=headers or None)
        if not in_header:
            self.ws.send(json.dumps({"token": token}))
        self.start, self.init, self.lines, self.data, self.ended = None, None, [], [], None
        self.joined = json.loads(self.ws.recv(timeout=60))  # from here on, every fragment published reaches it
        assert self.joined["type"] == "joined", self.joined

    def read_until_end(self, timeout: float = 60) -> dict:
        while True:
            message = self.ws.recv(timeout=timeout)
            if isinstance(message, bytes):
                if self.init is None:
                    self.init = message
                else:
                    self.data.append(message)
                    with contextlib.suppress(ConnectionClosed):  # read after the stream ended: no one to tell
                        self.ws.send(json.dumps({"ack": self.lines[-1]["frame"]}))  # as the page does
                continue
            line = json.loads(message)
            if line["type"] == "start":
                self.start = line
            elif line["type"] == "fragment":
                self.lines.append(line)
            else:
                self.ended = line
                return line

    def read_meanwhile(self) -> threading.Thread:
        """Read as the messages come (a viewer keeping up), until the end."""
        reader = threading.Thread(target=self.read_until_end, daemon=True)
        reader.start()
        return reader

    def file(self) -> bytes:
        return self.init + b"".join(self.data)
