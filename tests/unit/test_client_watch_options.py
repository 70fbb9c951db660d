"""A decode session's `frames` and `watch` open options (issue #59) on every client surface: the HTTP
client's WebSocket sessions (sync and async) and the gRPC client's DecodeSession (sync and async).

Each client runs against a real local server (a `websockets` server, a gRPC server) that speaks the
session contract: its requests read by the service's own parsers (protocol.sessions.parse_message,
session_proto.request_map), its answers built by the service's own message functions and carried
as the service carries them (msgpack, session_proto.reply_proto). Checked: the open the clients
put on the wire (the options only when given), `session.watch` (the url made absolute against the
client's base URL, its route prefix kept; relative over gRPC unless given one), a frames="none"
session answered chunk_done alone (no client waits for frames that do not come: a wait would time
out), and a resume's reopen, a checkpoint's attach and a drain's move keeping both options. Also
session_proto's round trips of the new fields and the client's refusals naming the field."""

from __future__ import annotations

import asyncio
import re
import secrets
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve as ws_serve

from vae_service.protocol.errors import WireErrorInfo
from vae_service.protocol.sessions import (
    attached_message,
    closed_message,
    error_message,
    fragment_message,
    moved_message,
    opened_message,
    parse_message,
)
from vae_service_client import AsyncVaeClient, InvalidRequest, VaeClient, Watch
from vae_service_client.frames import frames_message
from vae_service_client.grpc_client import AsyncVaeGrpcClient, VaeGrpcClient
from vae_service_client.grpc_gen import decode_pb2, decode_pb2_grpc
from vae_service_client.messages import pack
from vae_service_client.mp4 import Mp4Fragment
from vae_service_client.session_proto import reply_map, reply_proto, request_map, request_proto
from vae_service_client.sessions import SessionBook, open_fields, watch_of

H, W, C, SCALE = 2, 3, 4, 8
TIMEOUT_S = 5  # a client waiting for frames that never come fails within this, not the test's budget
TOKEN_CHARS = re.compile(r"[A-Za-z0-9_-]{43}")


def latents(t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, C, t, H, W)).astype(np.float32)


def frames_after(latent_frames: int, t: int) -> int:
    """Wan's frames for t more latent frames: the first latent frame is one frame, each later one four."""
    return 4 * t - 3 if latent_frames == 0 else 4 * t


# ---- the scripted service ------------------------------------------------------------------------
@dataclass
class Held:
    """One session the service holds: its open map, its token, and where each applied chunk ended
    ((latent frames, frames), from (0, 0))."""

    settings: dict
    token: str
    ends: list = field(default_factory=lambda: [(0, 0)])
    fragments: int = 0


class Service:
    """The session contract, scripted: Wan's frame counts, uint8 frames whose every pixel is its frame
    index, one mp4 fragment per latent frame (the first with the init segment); `frames: "none"`:
    each chunk answers its chunk_done alone; `watch: true`: `opened` (and `attached`) carry the
    watch map. Faults by chunk number (counted over the service): `drop` ends the connection without
    an answer (a lost replica), `move` answers `moved` (a drain). With `checkpoints`, each chunk_done
    says the latest checkpoint is where the chunk before it ended; a lost session is attached to from
    it, else refused session_lost (the client opens a new one and replays)."""

    def __init__(self):
        self.reset()

    def reset(self, drop=(), move=(), checkpoints: bool = False) -> None:
        self.drop, self.move, self.checkpoints = set(drop), set(move), checkpoints
        self.sessions: dict[str, Held] = {}
        self.received: list[tuple[str, dict]] = []  # every request as the service read it
        self.opens: list[bytes] = []  # each WebSocket open's raw bytes
        self.paths: list[str] = []  # each WebSocket's request path
        self.chunks = self.opened = 0

    def summary(self, sid: str) -> dict:
        held = self.sessions[sid]
        out = {
            "session": sid, "model": "tiny-wan", "quality": held.settings.get("quality", "lossless"),
            "precision": "fp32", "output": held.settings.get("output", "uint8"), "held_bytes": 4096,
            "idle_timeout_s": 30.0, "max_chunk_latent_frames": 8, "latent_channels": C, "spatial_scale": SCALE,
            "request_id": None,
        }  # fmt: skip
        if held.settings.get("watch"):
            out["watch"] = {"id": sid, "token": held.token, "url": f"/watch/{sid}#token={held.token}"}
        return out

    def answer(self, conn: dict, kind: str, fields: dict) -> tuple[list[dict], bool]:
        """A request's answers and whether the connection ends after them."""
        self.received.append((kind, fields))
        if kind == "open":
            sid, self.opened = f"r1.{self.opened}", self.opened + 1
            self.sessions[sid] = Held(dict(fields), secrets.token_urlsafe(32))
            conn["sid"] = sid
            return [opened_message(self.summary(sid))], False
        if kind == "attach":
            return self.attach(conn, fields)
        held = self.sessions[conn["sid"]]
        if kind == "close":
            latent_frames, frames = held.ends[-1]
            summary = {"frames": frames, "latent_frames": latent_frames}
            return [closed_message(summary, held.settings.get("output", "uint8"))], True
        number, self.chunks = self.chunks, self.chunks + 1
        if number in self.drop:
            if self.checkpoints:  # the keeper holds the session from its checkpoint
                del held.ends[len(held.ends) - 1 :]
            else:
                del self.sessions[conn["sid"]]
            return [], True
        if number in self.move:
            return [moved_message(conn["sid"])], True
        return self.chunk(held, fields), False

    def attach(self, conn: dict, fields: dict) -> tuple[list[dict], bool]:
        sid = fields["session"]
        if sid not in self.sessions:
            lost = WireErrorInfo("session_lost", "session", "no keeper holds it", None)
            return [error_message(lost)], True
        held = self.sessions[sid]
        latent_frames, frames = held.ends[-1]
        came_from = "handoff" if latent_frames == fields.get("latent_frames") else "checkpoint"
        conn["sid"] = sid
        where = {"latent_frames": latent_frames, "frames": frames, "checkpointed_latent_frames": latent_frames}
        return [attached_message({**self.summary(sid), **where}, came_from)], False

    def chunk(self, held: Held, fields: dict) -> list[dict]:
        latent_frames, frames = held.ends[-1]
        if fields.get("latent_frame") != latent_frames:
            wrong = WireErrorInfo("invalid_request", "latent_frame", f"the session is at {latent_frames}", None)
            return [error_message(wrong)]
        t = fields["latents"]["shape"][2]
        new = frames_after(latent_frames, t)
        messages = []
        if held.settings.get("frames", "all") == "all":
            if held.settings.get("output", "uint8") in ("mp4", "webm"):
                frame = frames
                for i in range(latent_frames, latent_frames + t):
                    n = 1 if i == 0 else 4
                    data = (b"init" if i == 0 else b"") + b"frag%d" % i
                    messages.append(fragment_message(Mp4Fragment(frame, n, data)))
                    frame += n
            else:
                pixels = np.zeros((1, new, H * SCALE, W * SCALE, 3), np.uint8)
                pixels[:] = np.arange(frames, frames + new, dtype=np.uint8)[None, :, None, None, None]
                messages.append(frames_message(0, frames, pixels))
        held.ends.append((latent_frames + t, frames + new))
        done = {
            "latent_frame": latent_frames, "latent_frames": latent_frames + t, "frames": frames + new,
            "precision": "fp32", "checkpointed_latent_frames": held.ends[-2][0] if self.checkpoints else 0,
            "timing": {"queue_ms": 0.5, "decode_ms": 7.0, "encode_ms": 0.0, "batch_size": 1, "preempted_ms": 0.0},
        }  # fmt: skip
        return [*messages, {"chunk_done": done}]


SERVICE = Service()


class Servicer(decode_pb2_grpc.VaeDecoderServicer):
    """DecodeSession as the service's servicer carries it: requests read with request_map, each
    answer written with reply_proto."""

    def DecodeSession(self, requests, context):  # noqa: N802 (the RPC's name)
        conn: dict = {}
        for request in requests:
            kind, fields = request_map(request)
            answers, ends = SERVICE.answer(conn, kind, fields)
            for message in answers:
                yield reply_proto(message)
            if ends:
                return


def websocket_handler(ws) -> None:
    SERVICE.paths.append(ws.request.path)
    conn: dict = {}
    try:
        while True:
            raw = ws.recv()
            kind, fields = parse_message(raw, 2**20)
            if kind == "open":
                SERVICE.opens.append(raw)
            answers, ends = SERVICE.answer(conn, kind, fields)
            for message in answers:
                ws.send(pack(message))
            if ends:
                return
    except ConnectionClosed:
        return


@pytest.fixture(scope="module")
def servers():
    """The WebSocket server's http base URL and the gRPC server's target."""
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    decode_pb2_grpc.add_VaeDecoderServicer_to_server(Servicer(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    with ws_serve(websocket_handler, "127.0.0.1", 0) as ws_server:
        threading.Thread(target=ws_server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{ws_server.socket.getsockname()[1]}", f"127.0.0.1:{port}"
    grpc_server.stop(0)


@pytest.fixture
def service():
    SERVICE.reset()
    return SERVICE


# ---- the clients, driven alike ----------------------------------------------------------------------
TRANSPORTS = ["websocket", "websocket-async", "grpc", "grpc-async"]


@dataclass
class Seen:
    """What a caller saw of one session."""

    answers: list = field(default_factory=list)
    kept_bytes: list = field(default_factory=list)  # after each chunk
    watch_at_open: Watch | None = None
    watch: Watch | None = None
    resumes: int = 0
    attaches: int = 0
    closed: dict | None = None


def client_of(transport: str, servers, prefix: str = "", http_base_url: str | None = None):
    http_url, target = servers
    kwargs = {"retries": 0, "timeout": TIMEOUT_S}
    return {
        "websocket": lambda: VaeClient(http_url + prefix, **kwargs),
        "websocket-async": lambda: AsyncVaeClient(http_url + prefix, **kwargs),
        "grpc": lambda: VaeGrpcClient(target, http_base_url=http_base_url, **kwargs),
        "grpc-async": lambda: AsyncVaeGrpcClient(target, http_base_url=http_base_url, **kwargs),
    }[transport]()


def run(transport: str, servers, chunks: list, prefix: str = "", http_base_url: str | None = None, **opens) -> Seen:
    """A session opened with `opens` over `transport`, `chunks` decoded in turn, then closed."""
    seen = Seen()
    if transport.endswith("async"):

        async def session() -> None:
            client = client_of(transport, servers, prefix, http_base_url)
            async with client.session(H, W, **opens) as s:
                seen.watch_at_open = s.watch
                for z in chunks:
                    seen.answers.append(await s.decode(z))
                    seen.kept_bytes.append(s.kept_bytes)
                seen.watch, seen.resumes, seen.attaches = s.watch, s.resumes, s.attaches
            seen.closed = s.closed
            await client.aclose()

        asyncio.run(session())
        return seen
    with client_of(transport, servers, prefix, http_base_url) as client, client.session(H, W, **opens) as s:
        seen.watch_at_open = s.watch
        for z in chunks:
            seen.answers.append(s.decode(z))
            seen.kept_bytes.append(s.kept_bytes)
        seen.watch, seen.resumes, seen.attaches = s.watch, s.resumes, s.attaches
    seen.closed = s.closed
    return seen


def opens_read(service: Service) -> list[dict]:
    return [fields for kind, fields in service.received if kind == "open"]


# ---- the open on the wire ----------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_clients_open_with_frames_and_watch_only_when_given(transport, servers, service):
    run(transport, servers, [], output="mp4", frames="none", watch=True)
    run(transport, servers, [], output="webm", frames="all", watch=False)
    run(transport, servers, [], output="mp4")
    base = {"height": H, "width": W, "quality": "lossless", "dtype": "float32"}
    assert opens_read(service) == [
        {**base, "output": "mp4", "frames": "none", "watch": True},
        {**base, "output": "webm"},  # the defaults are the server's: left off (a server before #59 opens it)
        {**base, "output": "mp4"},
    ]
    if transport.startswith("websocket"):  # the bytes: the open map alone, `watch` a msgpack true
        assert service.opens == [
            pack({"open": open_fields(H, W, output="mp4", frames="none", watch=True)}),
            pack({"open": open_fields(H, W, output="webm")}),
            pack({"open": open_fields(H, W, output="mp4")}),
        ]
        assert msgpack.unpackb(service.opens[0], raw=False)["open"]["watch"] is True


@pytest.mark.parametrize("asked", [{}, {"frames": "none"}, {"frames": "none", "watch": True}, {"watch": True}])
def test_the_grpc_open_carries_the_options_as_the_websockets_map(servers, service, asked):
    """The SessionOpen the gRPC client sends, read back by the servicer's request_map: the map the
    WebSocket client sends for the same arguments, proto3's zero values ("", false) as absent."""
    fields = open_fields(H, W, output="mp4", **asked)
    msg = decode_pb2.SessionRequest.FromString(request_proto({"open": fields}).SerializeToString())
    assert msg.open.frames == asked.get("frames", "") and msg.open.watch is asked.get("watch", False)
    assert request_map(msg) == ("open", fields)
    run("grpc", servers, [], output="mp4", **asked)
    assert opens_read(service) == [fields]


# ---- the watch answer --------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["websocket", "websocket-async"])
@pytest.mark.parametrize("prefix", ["", "/wan-app", "/wan-app/"])
def test_the_watch_url_is_absolute_beside_the_clients_base_url(transport, servers, service, prefix):
    seen = run(transport, servers, [latents(1)], prefix=prefix, output="webm", watch=True)
    watch = seen.watch_at_open
    assert isinstance(watch, Watch) and seen.watch == watch
    (sid,) = service.sessions
    assert watch.id == sid and TOKEN_CHARS.fullmatch(watch.token)
    assert watch.url == f"{servers[0]}{prefix.rstrip('/')}/watch/{sid}#token={watch.token}"
    assert service.paths == [f"{prefix.rstrip('/')}/sessions"]  # the same route prefix as the session's socket


@pytest.mark.parametrize("transport", ["grpc", "grpc-async"])
def test_the_grpc_watch_url_stays_relative_unless_given_an_http_base(transport, servers, service):
    relative = run(transport, servers, [], output="mp4", watch=True).watch
    assert relative.url == f"/watch/{relative.id}#token={relative.token}"
    base = "https://decode.example.com/wan-app/"
    absolute = run(transport, servers, [], output="mp4", watch=True, http_base_url=base).watch
    assert absolute.url == f"https://decode.example.com/wan-app/watch/{absolute.id}#token={absolute.token}"
    assert absolute.id != relative.id  # each session its own id and token
    assert absolute.token != relative.token


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_unwatched_session_has_no_watch(transport, servers, service):
    seen = run(transport, servers, [latents(1)], output="mp4")
    assert seen.watch_at_open is None and seen.watch is None


def test_watch_of_joins_a_relative_url_and_keeps_an_absolute_one():
    fields = {"id": "r.1", "token": "t", "url": "/watch/r.1#token=t"}
    assert watch_of(fields) == Watch("r.1", "t", "/watch/r.1#token=t")
    assert watch_of(fields, "http://h:8000").url == "http://h:8000/watch/r.1#token=t"
    assert watch_of(fields, "http://h:8000/p/").url == "http://h:8000/p/watch/r.1#token=t"
    assert watch_of({**fields, "url": "https://cdn/w#token=t"}, "http://h:8000").url == "https://cdn/w#token=t"
    assert watch_of(None, "http://h") is None and watch_of({}, "http://h") is None
    with pytest.raises(AttributeError):
        watch_of(fields).url = "/elsewhere"  # frozen


# ---- frames="none" -----------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("output", ["uint8", "mp4"])
def test_a_frames_none_chunk_answers_its_counts_and_timing_without_frames(transport, servers, service, output):
    chunks = [latents(1, 0), latents(2, 1), latents(1, 2)]
    full = run(transport, servers, chunks, output=output)
    bare = run(transport, servers, chunks, output=output, frames="none")
    counts = [(1, 0), (8, 1), (4, 9)]
    for all_, none, (frames, frame) in zip(full.answers, bare.answers, counts, strict=True):
        assert (none.frames, none.frame) == (all_.frames, all_.frame) == (frames, frame)
        assert (none.latent_frame, none.latent_frames) == (all_.latent_frame, all_.latent_frames)
        assert none.timing == all_.timing and none.timing["decode_ms"] == 7.0 and none.precision == "fp32"
        assert none.pixels is None
        if output == "uint8":
            assert all_.pixels.shape[1] == frames and all_.fragment is None and none.fragment is None
        else:
            assert all_.fragment and none.fragment == b""
    assert bare.closed["frames"] == full.closed["frames"] == 13
    assert bare.closed["latent_frames"] == 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_lost_frames_none_session_reopens_with_the_same_options_and_replays(transport, servers, service):
    """The connection drops at the third chunk with nothing checkpointed: the client opens a new
    session with the same open (frames none, watch), replays the two chunks it kept, then sends the
    third: its counts continue, and `watch` names the new session."""
    service.reset(drop={2})
    chunks = [latents(1, 0), latents(1, 1), latents(2, 2), latents(1, 3)]
    seen = run(transport, servers, chunks, output="mp4", frames="none", watch=True, resume=True)
    first, again = opens_read(service)
    assert first == again == open_fields(H, W, output="mp4", frames="none", watch=True)
    if transport.startswith("websocket"):
        assert service.opens[0] == service.opens[1]  # byte for byte
    assert seen.resumes == 1 and seen.attaches == 0
    assert [(a.frame, a.frames, a.fragment) for a in seen.answers] == [
        (0, 1, b""),
        (1, 4, b""),
        (5, 8, b""),
        (13, 4, b""),
    ]
    old, new = seen.watch_at_open, seen.watch
    assert new.id == "r1.1" and old.id == "r1.0" and new.token != old.token
    assert new.url.endswith(f"/watch/r1.1#token={new.token}")
    attaches = [fields for kind, fields in service.received if kind == "attach"]
    assert attaches == [{"session": "r1.0", "latent_frames": 2}]  # tried first, refused session_lost
    assert (seen.closed["frames"], seen.closed["latent_frames"]) == (17, 5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_checkpoints_trim_what_resume_keeps_and_a_lost_session_attaches_from_one(transport, servers, service):
    """Each chunk_done says the chunk before it is checkpointed: resume keeps one chunk's latents.
    The connection drops at the third chunk; the client attaches (the answer carries `watch`, the
    same session), replays the chunk after the checkpoint, and goes on."""
    service.reset(drop={2}, checkpoints=True)
    chunks = [latents(1, 0), latents(1, 1), latents(2, 2), latents(1, 3)]
    seen = run(transport, servers, chunks, output="webm", frames="none", watch=True, resume=True)
    one = len(pack({"chunk": {"latents": {"dtype": "float32", "shape": [1, C, 1, H, W], "data": latents(1).tobytes()},
                              "latent_frame": 0}}))  # fmt: skip
    assert seen.kept_bytes[0] == one and seen.kept_bytes[1] == one  # the latest chunk alone
    assert seen.kept_bytes[2] > one and seen.kept_bytes[3] == one
    assert len(opens_read(service)) == 1 and seen.resumes == 1 and seen.attaches == 1
    assert seen.watch == seen.watch_at_open and seen.watch.id == "r1.0"
    chunks_sent = [fields["latent_frame"] for kind, fields in service.received if kind == "chunk"]
    assert chunks_sent == [0, 1, 2, 1, 2, 4]  # the third chunk dropped, the second replayed from the checkpoint
    assert [(a.frame, a.frames) for a in seen.answers] == [(0, 1), (1, 4), (5, 8), (13, 4)]
    assert all(a.pixels is None and a.fragment == b"" for a in seen.answers)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_moved_frames_none_session_is_followed_and_stays_watched(transport, servers, service):
    service.reset(move={1})
    seen = run(transport, servers, [latents(1, 0), latents(1, 1), latents(1, 2)], output="mp4", frames="none",
               watch=True)  # fmt: skip
    assert seen.attaches == 1 and seen.resumes == 0 and len(opens_read(service)) == 1
    attaches = [fields for kind, fields in service.received if kind == "attach"]
    assert attaches == [{"session": "r1.0", "latent_frames": 1}]
    assert seen.watch == seen.watch_at_open and seen.watch.id == "r1.0"
    assert [(a.frame, a.frames, a.fragment) for a in seen.answers] == [(0, 1, b""), (1, 4, b""), (5, 4, b"")]


# ---- session_proto: the new fields both ways -----------------------------------------------------------
def test_the_options_cross_grpc_both_ways_and_proto3_zeros_read_as_not_given():
    for asked in ({"frames": "none", "watch": True}, {"frames": "none"}, {"watch": True}, {}):
        fields = open_fields(H, W, output="webm", **asked)
        msg = request_proto({"open": fields})
        assert request_map(decode_pb2.SessionRequest.FromString(msg.SerializeToString())) == ("open", fields)
    explicit = {"height": H, "width": W, "frames": "all", "watch": False}  # a map that names the defaults
    assert request_map(request_proto({"open": explicit})) == ("open", {"height": H, "width": W, "frames": "all"})
    zeros = decode_pb2.SessionRequest(open=decode_pb2.SessionOpen(height=H, width=W, frames="", watch=False))
    assert request_map(zeros) == ("open", {"height": H, "width": W})
    with pytest.raises(InvalidRequest) as err:  # what a SessionOpen cannot carry: refused naming the field
        request_proto({"open": {"height": H, "width": W, "watch": "yes"}})
    assert err.value.field == "watch"


def test_opened_and_attached_carry_watch_across_grpc_only_when_watched():
    service = Service()
    conn: dict = {}
    (watched,), _ = service.answer(conn, "open", {"height": H, "width": W, "output": "mp4", "watch": True})
    (plain,), _ = service.answer({}, "open", {"height": H, "width": W, "output": "mp4"})
    service.answer(conn, "chunk", {"latents": {"shape": [1, C, 1, H, W]}, "latent_frame": 0})
    (attached,), _ = service.answer({}, "attach", {"session": "r1.0", "latent_frames": 1})
    for message in (watched, plain, attached):
        msg = reply_proto(message)
        wire = decode_pb2.SessionReply.FromString(msg.SerializeToString())
        kind = wire.WhichOneof("kind")
        assert getattr(wire, kind).HasField("watch") == ("watch" in message[kind])
        assert reply_map(wire) == message
    assert watched["opened"]["watch"] == attached["attached"]["watch"]
    assert TOKEN_CHARS.fullmatch(watched["opened"]["watch"]["token"])


# ---- refused here, before any I/O -------------------------------------------------------------------
@pytest.mark.parametrize(
    "asked, field",
    [
        ({"frames": "some"}, "frames"),
        ({"frames": "None"}, "frames"),
        ({"frames": ""}, "frames"),
        ({"frames": None}, "frames"),
        ({"frames": 0}, "frames"),
        ({"frames": ["none"]}, "frames"),
        ({"watch": "yes"}, "watch"),
        ({"watch": 1}, "watch"),
        ({"watch": None}, "watch"),
        ({"watch": True, "output": "uint8"}, "watch"),
        ({"watch": True, "output": "float"}, "watch"),
    ],
)
def test_bad_options_are_refused_naming_the_field_before_connecting(asked, field):
    for client in (VaeClient("http://127.0.0.1:9", retries=0, timeout=1), VaeGrpcClient("127.0.0.1:9", retries=0)):
        with pytest.raises(InvalidRequest) as err:
            client.session(H, W, **{"output": "mp4", **asked})  # nothing listens there: a refusal, not a connect
        assert err.value.field == field and err.value.status == 400, str(err.value)
        client.close()
    with pytest.raises(InvalidRequest) as err:
        open_fields(H, W, **{"output": "mp4", **asked})
    assert err.value.field == field


def test_a_misspelled_frames_value_gets_a_close_match():
    with pytest.raises(InvalidRequest, match="did you mean 'none'"):
        open_fields(H, W, frames="nnoe")


def test_a_file_is_not_written_from_a_session_that_sends_no_fragments(tmp_path):
    with pytest.raises(InvalidRequest) as err:
        SessionBook(open_fields(H, W, output="mp4", frames="none", watch=True), path=tmp_path / "x.mp4")
    assert err.value.field == "path" and not (tmp_path / "x.mp4").exists()
