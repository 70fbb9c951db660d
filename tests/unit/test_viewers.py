"""Viewers of a decode session (serving/viewers/, serving/wire/watch_routes.py): the fan-out's rules
framework-free, then the routes over real loopback connections (tests/watch_server.py: the
replica's own service and routes under uvicorn, no Ray) with the tiny causal Wan decoder.

- the denoiser that asks `frames: none` gets only chunk_done; a viewer gets the session's own file
  (the same bytes a `frames: all` session answers), init segment first, from its join point on;
- a viewer's queue is bounded: behind by a whole queue it drops to the newest fragment (counted),
  and neither the session nor other viewers wait for it;
- tokens: a wrong one, none and an unknown session are refused alike; the service's token watches
  every session; viewers' limits are 429 naming `viewers`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

from tests.session_wire import decoded_video, latents
from tests.watch_clients import StreamViewer, open_session, replies_until_done, say, ws_of
from tests.watch_server import watch_server
from vae_service.config import ServiceConfig, Watch
from vae_service.engine.request.errors import Overloaded
from vae_service.protocol.errors import Unauthenticated
from vae_service.serving.viewers.feed import STREAM, WEBRTC, Fragment, Viewer
from vae_service.serving.viewers.hub import ViewerHub
from vae_service.serving.wire.session_socket import SessionCalls
from vae_service.serving.wire.watch_routes import Acks
from vae_service_client.messages import latents_map, pack

TOKEN_FILE_TOKEN = "service-token-for-tests"


def fragment(i: int) -> Fragment:
    return Fragment(i * 4, 4, bytes([i % 256]) * 8, np.zeros((4, 2, 2, 3), np.uint8), 0.0)


def hub_of(**watch) -> ViewerHub:
    return ViewerHub(lambda: Watch(**watch), lambda: 1.5, lambda token: token == TOKEN_FILE_TOKEN)


# ---- the fan-out's rules ---------------------------------------------------------------------
@pytest.mark.parametrize("bound", [1, 2, 5])
@pytest.mark.parametrize("per_chunk", [1, 3])
@pytest.mark.parametrize("chunks", [0, 1, 4, 11, 30])
def test_a_viewer_behind_by_its_bound_drops_its_backlog_and_goes_on_at_the_newest_chunk(bound, per_chunk, chunks):
    viewer = Viewer(STREAM, bound)
    published = 0
    for _ in range(chunks):
        viewer.offer([fragment(published + i) for i in range(per_chunk)])
        published += per_chunk
        assert len(viewer.queue) <= bound - 1 + per_chunk
    kept = [f.frame // 4 for f in viewer.queue]
    assert viewer.dropped + len(kept) == published
    if published:
        assert kept[-per_chunk:] == list(range(published - per_chunk, published))  # the newest chunk, whole
        assert kept == list(range(kept[0], published))  # what it keeps is consecutive


def test_a_late_viewer_starts_at_the_next_fragment_and_every_viewer_ends_after_its_queue():
    async def run():
        hub = hub_of()
        watched = hub.watch("r.s")
        feed = hub.authorize(watched.watch_id, watched.token)
        early = hub.join(feed, STREAM)
        hub.publish("r.s", [fragment(0), fragment(1)], b"init", "video/mp4")
        late = hub.join(feed, STREAM)
        hub.publish("r.s", [fragment(2)], b"init", "video/mp4")
        hub.end("r.s", "closed")
        got = {}
        for name, viewer in (("early", early), ("late", late)):
            frames = []
            while (f := await viewer.next()) is not None:
                frames.append(f.frame)
            got[name] = (frames, viewer.ended)
        return got, feed.frames

    got, frames = asyncio.run(run())
    assert got == {"early": ([0, 4, 8], "closed"), "late": ([8], "closed")}
    assert frames == 12


def test_a_webrtc_viewer_joining_between_chunks_is_shown_the_latest_frame_at_once():
    hub = hub_of()
    feed = hub.watch("r.s")
    assert not hub.join(feed, WEBRTC).queue  # nothing published yet: nothing to show
    last = Fragment(4, 4, b"x", np.arange(4 * 2 * 2 * 3, dtype=np.uint8).reshape(4, 2, 2, 3), 0.0)
    hub.publish("r.s", [fragment(0), last], b"init", "video/mp4")
    (shown,) = hub.join(feed, WEBRTC).queue
    assert (shown.frame, shown.frames) == (7, 1) and np.array_equal(shown.pixels, last.pixels[-1:])
    assert not hub.join(feed, STREAM).queue  # a MediaSource viewer starts at the next fragment


def test_wrong_missing_and_unknown_are_refused_alike_and_the_services_token_watches_any():
    hub = hub_of()
    a, b = hub.watch("r.a"), hub.watch("r.b")
    refusals = []
    for watch_id, given in (
        (a.watch_id, None),
        (a.watch_id, "x" * 43),
        (a.watch_id, b.token),  # another session's token
        ("r.a", a.token),  # the session's own id is no watch id: a viewer never learns it
        ("r.zz", a.token),
    ):
        with pytest.raises(Unauthenticated) as refused:
            hub.authorize(watch_id, given)
        refusals.append((refused.value.field, str(refused.value)))
    assert len(set(refusals)) == 1 and refusals[0][0] == "token"
    assert hub.authorize(a.watch_id, a.token) is a and hub.authorize(b.watch_id, TOKEN_FILE_TOKEN) is b
    assert len(a.token) >= 43 and a.token != b.token and a.watch_id.startswith("r.") and a.watch_id != "r.a"
    hub.end("r.a", "closed")  # a token expires with its session
    with pytest.raises(Unauthenticated):
        hub.authorize(a.watch_id, a.token)
    # a session that came from another replica keeps its watch id and token
    moved = hub.watch("r.a", a.token, a.watch_id)
    assert hub.authorize(a.watch_id, a.token) is moved


@pytest.mark.parametrize(("per_session", "per_replica"), [(1, 8), (3, 8), (8, 2), (4, 5)])
def test_viewers_past_either_limit_are_refused_naming_viewers(per_session, per_replica):
    hub = hub_of(max_viewers_per_session=per_session, max_viewers=per_replica)
    feeds = [hub.watch(s) for s in ("r.a", "r.b")]
    joined = []
    for _ in range(per_session + per_replica):
        for feed in feeds:
            try:
                joined.append(hub.join(feed, STREAM))
            except Overloaded as exc:
                assert exc.field == "viewers" and exc.retry_after_s == 1.5
    counts = [len(f.viewers) for f in feeds]
    assert max(counts) <= per_session and sum(counts) == min(per_replica, 2 * per_session)
    hub.leave(feeds[0], next(iter(feeds[0].viewers)))
    assert hub.join(feeds[0], STREAM) is not None  # one left: one more may join


# ---- over the routes ---------------------------------------------------------------------------
def config_of(wan_dir, **watch) -> ServiceConfig:
    return ServiceConfig(
        model=str(wan_dir),
        cpu_threads=1,
        serving={"fit_prices_at_start": False},
        watch=watch,
        auth_token_file=None,
    )


@pytest.fixture(scope="module")
def server(wan_dir):
    with watch_server(config_of(wan_dir, viewer_queue_fragments=64)) as running:
        yield running


def chunks(ws, seeds: list[tuple[int, int]], at: int = 0, side: tuple[int, int] | None = None) -> list[list[dict]]:
    answers = []
    for t, seed in seeds:
        z = latents(t, seed) if side is None else np.random.default_rng(seed).standard_normal((1, 4, t, *side))
        ws.send(pack({"chunk": {"latents": latents_map(z.astype(np.float32)), "latent_frame": at}}))
        answers.append(replies_until_done(ws))
        at += t
    return answers


@pytest.mark.parametrize("in_header", [True, False])
def test_a_denoiser_asking_no_frames_drives_a_session_its_viewers_get_as_its_own_file(server, in_header):
    plan = [(2, 1), (1, 2), (3, 3)]
    own_ws, _ = open_session(server.url)
    own = chunks(own_ws, plan)
    own_ws.send(pack({"close": {}}))
    own_file = b"".join(m["fragment"] for answer in own for m in answer if "fragment" in m)

    ws, opened = open_session(server.url, frames="none", watch=True)
    watch = opened["opened"]["watch"]
    assert watch["url"] == f"/watch/{watch['id']}#token={watch['token']}"
    session = opened["opened"]["session"]  # what attaches to the session: never in what a viewer is given
    assert watch["id"].split(".")[0] == session.split(".")[0] and session not in str(watch)
    viewer = StreamViewer(server.url, watch["id"], watch["token"], in_header)
    answers = chunks(ws, plan)
    ws.send(pack({"close": {}}))
    closed = msgpack.unpackb(ws.recv(timeout=60), raw=False)
    ended = viewer.read_until_end()

    assert all(len(a) == 1 and "chunk_done" in a[0] for a in answers)  # frames: none
    assert [a[0]["chunk_done"]["frames"] for a in answers] == [m[-1]["chunk_done"]["frames"] for m in own]
    assert ended == {"type": "ended", "reason": "closed", "frames": closed["closed"]["frames"], "dropped": 0}
    assert viewer.start["content_type"].startswith('video/mp4; codecs="avc1.') and viewer.start["frame"] == 0
    assert viewer.file() == own_file  # the viewer's file is the session's own, byte for byte
    counts = [x["frames"] for x in viewer.lines]
    assert [x["frame"] for x in viewer.lines] == [sum(counts[:i]) for i in range(len(counts))]  # consecutive
    assert len(decoded_video(viewer.file())) == closed["closed"]["frames"]


def test_a_viewer_joining_late_gets_the_init_segment_then_the_fragments_from_its_join(server):
    ws, opened = open_session(server.url, watch=True)
    watch = opened["opened"]["watch"]
    first = chunks(ws, [(2, 5)])
    viewer = StreamViewer(server.url, watch["id"], watch["token"])
    second = chunks(ws, [(2, 6)], at=2)
    ws.send(pack({"close": {}}))
    ws.recv(timeout=60)
    viewer.read_until_end()
    joined_at = first[0][-1]["chunk_done"]["frames"]
    assert viewer.start["frame"] == joined_at == viewer.lines[0]["frame"]
    fragments = [m["fragment"] for m in second[0] if "fragment" in m]  # frames: all by default
    assert viewer.data == fragments
    frames = decoded_video(viewer.file())  # a file a player plays from the viewer's keyframe on
    assert len(frames) == second[0][-1]["chunk_done"]["frames"] - joined_at


@pytest.mark.parametrize(
    "how",
    ["wrong-header", "none-header", "wrong-message", "unknown-session", "other-sessions-token", "text-garbage"],
)
def test_a_viewer_without_the_sessions_token_is_refused_alike_whether_or_not_the_session_exists(server, how):
    ws, opened = open_session(server.url, watch=True)
    other_ws, other = open_session(server.url, watch=True)
    session, token = opened["opened"]["watch"]["id"], opened["opened"]["watch"]["token"]
    target, given, in_header = {
        "wrong-header": (session, "A" * 43, True),
        "none-header": (session, None, False),
        "wrong-message": (session, "A" * 43, False),
        "unknown-session": (session[:-4] + "beef", token, False),
        "other-sessions-token": (session, other["opened"]["watch"]["token"], False),
        "text-garbage": (session, None, False),
    }[how]
    answers = []
    for name in (target, session[:-4] + "0000"):  # the same refusal for a session that does not exist
        try:
            viewer = ws_of(
                server.url,
                f"/watch/{name}/stream",
                additional_headers=({"Authorization": f"Bearer {given}"} if in_header else None),
            )
        except Exception as refused:  # the handshake answered with HTTP
            answers.append(
                (
                    "http",
                    getattr(getattr(refused, "response", None), "status_code", None),
                    getattr(getattr(refused, "response", None), "body", None),
                )
            )
            continue
        if not in_header:
            viewer.send("not json" if how == "text-garbage" else json.dumps({"token": given}))
        with pytest.raises(ConnectionClosed):
            while True:
                viewer.recv(timeout=30)
        answers.append(("ws", viewer.close_code, viewer.close_reason))
    assert answers[0] == answers[1]
    assert answers[0][:2] in {("ws", 4401), ("http", 401)}
    if answers[0][0] == "ws":
        assert answers[0][2] == "unauthorized"
    else:
        assert json.loads(bytes(answers[0][2]))["error"]["type"] == "unauthenticated"
    for socket in (ws, other_ws):
        socket.send(pack({"close": {}}))


def test_the_watch_page_is_the_same_bytes_for_every_id_with_a_strict_policy(server):
    pages = [httpx.get(f"{server.url}/watch/{name}") for name in ("a.b", "nothing-here", "r." + "0" * 32)]
    assert {p.status_code for p in pages} == {200} and len({p.content for p in pages}) == 1
    policy = pages[0].headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    assert pages[0].headers["referrer-policy"] == "no-referrer"


def test_a_handles_session_is_watched_and_answers_no_frames_when_asked(server):
    calls = SessionCalls(server.service)
    opened = server.call(calls.open(height=6, width=10, output="webm", frames="none", watch=True))
    session, watch = opened["session"], opened["watch"]
    viewer = StreamViewer(server.url, watch["id"], watch["token"])
    done = server.call(calls.chunk(session, latents(2, 9), 0))
    server.call(calls.close(session))
    ended = viewer.read_until_end()
    assert set(done) == {"done"} and done["done"]["frames"] == ended["frames"] > 0
    assert viewer.start["content_type"].startswith("video/webm") and len(viewer.data) == 2
    assert len(decoded_video(viewer.file())) == ended["frames"]


def test_a_watch_for_a_pixel_output_or_a_bad_frames_value_is_refused_naming_the_field(server):
    for fields, field in (
        ({"watch": True, "output": "uint8"}, "watch"),
        ({"frames": "some"}, "frames"),
        ({"watch": "yes"}, "watch"),
    ):
        ws = ws_of(server.url, "/sessions")
        refused = say(ws, "open", {"height": 6, "width": 10, "output": "mp4", **fields})
        assert (refused["error"]["type"], refused["error"]["field"]) == ("invalid_request", field)


def test_a_stalled_viewer_drops_fragments_while_the_session_and_a_healthy_viewer_miss_nothing(wan_dir):
    with watch_server(config_of(wan_dir, viewer_queue_fragments=4)) as running:
        ws = ws_of(running.url, "/sessions")
        opened = say(ws, "open", {"height": 12, "width": 12, "output": "mp4", "frames": "none", "watch": True})
        session, token = opened["opened"]["watch"]["id"], opened["opened"]["watch"]["token"]
        # it joins, then reads and acknowledges nothing (a browser tab in the background, a dead link)
        stalled = ws_of(
            running.url, f"/watch/{session}/stream", additional_headers={"Authorization": f"Bearer {token}"}
        )
        healthy = StreamViewer(running.url, session, token)
        reading = healthy.read_meanwhile()
        answers = chunks(ws, [(3, seed) for seed in range(8)], side=(12, 12))
        ws.send(pack({"close": {}}))
        closed = msgpack.unpackb(ws.recv(timeout=60), raw=False)
        reading.join(60)
        ended = healthy.ended
        dropped = running.service.sessions.viewers.describe()["fragments_dropped"]
        last = None
        with contextlib.suppress(ConnectionClosed):  # its stream ends with the session, acknowledged or not
            while True:
                last = stalled.recv(timeout=30)
        stalled_end = json.loads(last)
        wait_for(lambda: running.service.sessions.connections == 0, "every viewer's connection given back")
        assert running.service.sessions.viewers.viewer_count() == 0
    assert all("chunk_done" in a[-1] for a in answers) and len(answers) == 8
    assert ended["dropped"] == 0 and len(healthy.data) == 24  # one fragment per latent frame, none missed
    assert len(decoded_video(healthy.file())) == closed["closed"]["frames"]
    assert dropped > 0  # the stalled viewer's: counted, never waited for
    assert (stalled_end["type"], stalled_end["reason"], stalled_end["dropped"]) == ("ended", "closed", dropped)


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_viewer_waiting_to_send_its_token_holds_a_session_connection_from_its_first_moment(server):
    before = server.service.sessions.connections
    with ws_of(server.url, "/watch/r.nothing/stream") as waiting:
        wait_for(lambda: server.service.sessions.connections == before + 1, "the waiting viewer's connection")
        waiting.send(json.dumps({"token": "A" * 43}))
        with pytest.raises(ConnectionClosed):
            waiting.recv(timeout=30)
        assert (waiting.close_code, waiting.close_reason) == (4401, "unauthorized")
    wait_for(lambda: server.service.sessions.connections == before, "given back with the refusal")


def test_an_acknowledgement_of_a_fragment_not_sent_opens_no_room():
    async def run():
        acks = Acks(2)
        acks.sent(0)
        acks.sent(4)

        class Socket:
            def __init__(self, texts):
                self.messages = [{"type": "websocket.receive", "text": t} for t in texts]

            async def receive(self):
                if self.messages:
                    return self.messages.pop(0)
                return {"type": "websocket.disconnect"}

        await acks.read(Socket([json.dumps({"ack": 2**62}), json.dumps({"ack": "4"}), "not json"]))
        full_after_hostile = acks.full
        await acks.read(Socket([json.dumps({"ack": 0})]))
        return full_after_hostile, list(acks.unacked)

    assert asyncio.run(run()) == (True, [4])
