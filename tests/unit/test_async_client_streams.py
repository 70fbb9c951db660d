"""The async HTTP client reads a streamed mp4 as the sync one does: a stream that ends with the
service's error box, or that is cut (before its summary, inside a box, the connection dropped),
raises the same error in both, after the same media bytes were written; a whole stream gives the
same summary. The bodies are a real replica core's (a wan DecodeService: a clip, and a clip whose
encoder fails at its second fragment), served by a real HTTP server on this machine; a cut is the
injected fault (a transport that ends the body early)."""

import asyncio
import http.server
import io
import threading

import pytest
import torch

from vae_service.config import ServiceConfig
from vae_service.serving.decode_service import DecodeService
from vae_service.serving.outputs import video_stream
from vae_service.serving.wire.http_routes import decode_events
from vae_service_client import AsyncVaeClient, VaeClient, VaeServiceError
from vae_service_client.messages import MSGPACK, pack, request_map
from vae_service_client.mp4 import BoxReader

Z = torch.randn(1, 4, 3, 3, 5, generator=torch.Generator().manual_seed(0))


async def streamed_body(service: DecodeService) -> bytes:
    """The body of `POST /decode` with a streamed mp4 answer, as the replica's HTTP route sends it."""
    events = decode_events(service, pack(request_map(Z, "lossless", "mp4", stream=True)), MSGPACK)
    opened = await anext(events)
    assert opened.status == 200 and opened.media_type.startswith("video/mp4")
    return b"".join([data async for data in events])


def failing_writer(make_writer):
    """Injected: an mp4 writer whose second fragment fails (after the first went out)."""

    def writer(*args):
        made = make_writer(*args)
        fragment, calls = made.fragment, []

        def second_fails(frames):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("x264 gave up")
            return fragment(frames)

        made.fragment = second_fails
        return made

    return writer


@pytest.fixture(scope="module")
def bodies(wan_dir) -> dict[str, bytes]:
    async def made() -> dict[str, bytes]:
        config = ServiceConfig(model=str(wan_dir), device="cpu", cpu_threads=1, serving={"fit_prices_at_start": False})
        whole = await streamed_body(DecodeService(config))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(video_stream, "video_writer", failing_writer(video_stream.video_writer))
            failed = await streamed_body(DecodeService(config))
        return {"whole": whole, "failed": failed}

    return asyncio.run(made())


class Server:
    """A local HTTP server answering every POST with `body`, chunked in small pieces; `dropped`: the
    connection closes before the body's last chunk (a transport that went away)."""

    def __init__(self):
        self.body, self.dropped = b"", False
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(200)
                self.send_header("content-type", 'video/mp4; codecs="avc1.64000a"')
                self.send_header("x-vae-stream", "mp4")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                body = served.body
                for at in range(0, len(body), 500):  # boxes straddle the pieces
                    piece = body[at : at + 500]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                if served.dropped:
                    self.close_connection = True
                    return
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server():
    served = Server()
    yield served
    served.http.shutdown()
    served.http.server_close()


def outcome(error: BaseException | None, summary) -> tuple:
    if error is None:
        return ("summary", summary.fields)
    if isinstance(error, VaeServiceError):
        return (type(error), error.status, error.type, error.field, error.message)
    return (type(error),)


def sync_decode(url: str) -> tuple[tuple, bytes]:
    out = io.BytesIO()
    with VaeClient(url, retries=0) as client:
        try:
            summary = client.decode_mp4(Z, out)
        except Exception as error:
            return outcome(error, None), out.getvalue()
    return outcome(None, summary), out.getvalue()


async def async_decode(url: str) -> tuple[tuple, bytes]:
    out = io.BytesIO()
    async with AsyncVaeClient(url, retries=0) as client:
        try:
            summary = await client.decode_mp4(Z, out)
        except Exception as error:
            return outcome(error, None), out.getvalue()
    return outcome(None, summary), out.getvalue()


def media_of(body: bytes) -> bytes:
    return BoxReader().feed(body)


RAISED = {  # what each case raises in both clients (None: whatever the transport raises, or nothing)
    "error box": "encoding the decoded pixels as mp4 failed",
    "cut before its summary": "ended before its summary",
    "cut inside a box": "ended inside a box",
    "connection dropped": None,
    "whole": None,
}


@pytest.mark.parametrize("case", list(RAISED))
async def test_the_async_client_raises_on_an_mp4_streams_error_box_or_cut_as_the_sync_one_does(server, bodies, case):
    whole_media = media_of(bodies["whole"])
    server.body, server.dropped = {
        "error box": (bodies["failed"], False),
        "cut before its summary": (whole_media, False),
        "cut inside a box": (whole_media[:-9], False),
        "connection dropped": (bodies["whole"][:-9], True),
        "whole": (bodies["whole"], False),
    }[case]
    sync_outcome, sync_written = await asyncio.to_thread(sync_decode, server.url)
    async_outcome, async_written = await async_decode(server.url)
    assert async_outcome == sync_outcome and async_written == sync_written
    if case == "whole":
        reader = BoxReader()
        reader.feed(bodies["whole"])
        assert sync_outcome == ("summary", reader.close()) and sync_written == whole_media
        return
    assert sync_outcome[0] != "summary"  # raised, not answered
    if RAISED[case] is not None:
        assert issubclass(sync_outcome[0], VaeServiceError) and RAISED[case] in sync_outcome[4]
    if case == "error box":
        assert sync_outcome[3] == "output" and sync_written == media_of(bodies["failed"])
        assert 0 < len(sync_written) < len(whole_media)  # the fragment before the failure, written
