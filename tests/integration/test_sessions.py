"""Decode sessions on the real service: a WebSocket client (the `websockets` library speaking the
documented messages), Serve handles pinned by the session router, and the Ray actor. One
deployment of the tiny causal Wan decoder with two replicas serves every test here.

Each test checks what a denoiser relies on: frames after every chunk, the chunks' frames joined
equal to the whole /decode answer bit for bit, bad chunks refused naming the field with the session
still exact afterwards, the room priced at open (413/429), idle expiry, a disconnect freeing the
session, a killed replica answering `session_lost`, and a viewer relayed from the session's replica."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.browser import avc1_codecs, browser_page, require_chromium
from tests.integration.conftest import SESSION_CONNECTIONS, SESSION_SLOTS
from tests.session_wire import (
    C,
    H,
    W,
    chunk_answer,
    kill_owner,
    latents,
    pixels_of,
    receive,
    replica_health,
    send,
    sessions_open,
    wait_until,
    whole_answer,
    ws_url,
)
from tests.watch_clients import StreamViewer, open_session
from vae_service.config import Encoding
from vae_service_client import VaeClient
from vae_service_client.messages import latents_map
from vae_service_client.tensors import decode_tensor

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("chunking", [[1, 1, 1, 1, 1], [2, 3], [4, 1], [1, 4]], ids=str)
def test_chunks_joined_are_the_whole_decode_bit_for_bit_with_frames_after_each_chunk(sessions_app, chunking):
    z = latents(sum(chunking), seed=len(chunking))
    with connect(ws_url(sessions_app)) as ws:
        send(ws, "open", {"height": H, "width": W})
        opened = receive(ws)["opened"]
        assert opened["quality"] == "lossless" and opened["held_bytes"] > 0 and opened["latent_channels"] == C
        frames, start = [], 0
        for t in chunking:
            messages, done = chunk_answer(ws, z[:, :, start : start + t], start)
            assert "chunk_done" in done, done
            assert messages and messages[0]["frame"] == sum(m.shape[1] for m in frames)
            frames.append(pixels_of(messages))
            start += t
            assert done["chunk_done"]["latent_frames"] == start
        send(ws, "close", {})
        closed = receive(ws)["closed"]
    whole = whole_answer(sessions_app, z)
    joined = np.concatenate(frames, axis=1)
    assert closed == {"frames": joined.shape[1], "latent_frames": sum(chunking)}
    np.testing.assert_array_equal(joined, whole)


@pytest.mark.parametrize(
    "bad, field",
    [
        (lambda z: z[:, :2], "latents"),  # wrong channels
        (lambda z: np.concatenate([z, z[:, :, :, :1]], axis=3), "height"),
        (lambda z: np.concatenate([z, z[..., :1]], axis=4), "width"),
        (lambda z: np.where(np.arange(z.size).reshape(z.shape) == 3, np.nan, z).astype(np.float32), "latents"),
        (lambda z: np.concatenate([z, z, z], axis=2), "latents"),  # 6 frames: over max_session_chunk_frames (4)
    ],
    ids=["channels", "height", "width", "nan", "chunk-bound"],
)
def test_a_bad_chunk_is_refused_naming_its_field_and_the_session_goes_on_exactly(sessions_app, bad, field):
    z = latents(4, seed=7)
    with connect(ws_url(sessions_app)) as ws:
        send(ws, "open", {"height": H, "width": W})
        receive(ws)
        first, _ = chunk_answer(ws, z[:, :, :1], 0)
        _, error = chunk_answer(ws, bad(z[:, :, 1:3]), 1)
        assert error["error"]["field"] == field, error
        assert error["error"]["type"] in ("invalid_request", "payload_too_large")
        _, out_of_order = chunk_answer(ws, z[:, :, 2:4], 2)  # skips latent frame 1
        assert out_of_order["error"]["field"] == "latent_frame"
        rest, done = chunk_answer(ws, z[:, :, 1:4], 1)
        assert "chunk_done" in done
    whole = whole_answer(sessions_app, z)
    np.testing.assert_array_equal(np.concatenate([pixels_of(first), pixels_of(rest)], axis=1), whole)


def test_open_errors_name_the_field_and_end_the_connection(sessions_app):
    cases = [
        ({"height": H}, "width"),
        ({"height": H, "width": W, "quality": "preview"}, "quality"),
        ({"height": H, "width": W, "output": "png"}, "output"),
        ({"height": H, "width": W, "dtype": "int8"}, "dtype"),
        ({"height": H, "width": W, "colour": 1}, "colour"),
    ]
    for fields, field in cases:
        with connect(ws_url(sessions_app)) as ws:
            send(ws, "open", fields)
            error = receive(ws)["error"]
            assert (error["type"], error["field"]) == ("invalid_request", field), error
            with pytest.raises(ConnectionClosed):
                receive(ws)


def test_sessions_over_the_room_are_refused_at_open_and_a_disconnect_frees_at_once(sessions_app):
    """max_sessions 3 per replica, two replicas: the seventh is refused with 429 + retry_after; a
    client that disconnects without `close` frees its session (the idle timeout, 300 s, frees none
    during the test)."""
    sockets = []
    try:
        for _ in range(6):
            ws = connect(ws_url(sessions_app))
            send(ws, "open", {"height": H, "width": W})
            assert "opened" in receive(ws)
            sockets.append(ws)
        refused = connect(ws_url(sessions_app))
        send(refused, "open", {"height": H, "width": W})
        error = receive(refused)["error"]
        assert (error["type"], error["field"]) == ("overloaded", "session") and error["retry_after"] > 0
        refused.close()
        assert sessions_open(sessions_app) == 6
    finally:
        for ws in sockets:
            ws.close()
    wait_until(lambda: sessions_open(sessions_app) == 0, 60, "the disconnected sessions freed")


def test_idle_connections_beyond_the_decode_slots_never_hold_a_decode(sessions_app):
    """Twelve WebSockets that never send `open` (as many as the two replicas' 2 x 6 decode slots):
    each is held or refused at once (429 naming `session`) where its replica's 4 session connections
    are taken, so 2 slots of each stay free: a /decode is answered while they all still wait, and
    /health counts them."""
    sockets, kept = [], []
    try:
        for _ in range(12):
            sockets.append(connect(ws_url(sessions_app), open_timeout=30))
        # a refusal is sent right after its handshake: whatever says nothing for 3 s is held
        with ThreadPoolExecutor(len(sockets)) as pool:
            answers = list(pool.map(first_word, sockets))
        for ws, answer in zip(sockets, answers, strict=True):
            if answer is None:
                kept.append(ws)
            else:
                assert (answer["error"]["type"], answer["error"]["field"]) == ("overloaded", "session"), answer
        z = latents(2, seed=61)
        answer = VaeClient(sessions_app, timeout=60).decode(z).output
        np.testing.assert_array_equal(answer, whole_answer(sessions_app, z))
        health = replica_health(sessions_app, 2)
        assert sum(h["sessions"]["connections"] for h in health.values()) == len(kept)
        assert all(h["sessions"]["max_connections"] == SESSION_CONNECTIONS for h in health.values())
        # however Serve spread them, a replica holds its 4 connections, never all of its 6 decode slots
        assert max(h["sessions"]["connections"] for h in health.values()) == SESSION_CONNECTIONS < SESSION_SLOTS
        for ws in kept:  # still waiting for their open
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.05)
    finally:
        for ws in sockets:
            ws.close()
    wait_until(lambda: connections(sessions_app) == 0, 60, "the closed connections given back")


def connections(url: str, replicas: int = 2) -> int:
    return sum(h["sessions"]["connections"] for h in replica_health(url, replicas).values())


def first_word(ws) -> dict | None:
    try:
        return receive(ws, timeout=3)
    except TimeoutError:
        return None


def test_a_connection_that_never_opens_is_closed_naming_open(expiring_sessions_app):
    with connect(ws_url(expiring_sessions_app)) as ws:
        error = receive(ws, timeout=60)["error"]  # open_timeout_s 3
        assert (error["type"], error["field"]) == ("body_timeout", "open"), error
        with pytest.raises(ConnectionClosed):
            receive(ws)
    wait_until(lambda: connections(expiring_sessions_app, 1) == 0, 60, "its connection given back")


def test_an_idle_session_expires_and_its_next_chunk_names_the_frames_it_had(expiring_sessions_app):
    z = latents(2, seed=3)
    with connect(ws_url(expiring_sessions_app)) as ws:
        send(ws, "open", {"height": H, "width": W})
        receive(ws)
        chunk_answer(ws, z[:, :, :2], 0)
        time.sleep(3.0)  # idle_timeout_s 1.5, swept every second; the connection waits 3 s more
        _, error = chunk_answer(ws, z[:, :, :1], 2)
        assert error["error"]["type"] == "session_expired"
        assert error["error"]["frames"] == 5 and error["error"]["latent_frames"] == 2
        assert "5 frames" in error["error"]["message"]


def test_an_expired_sessions_connection_says_so_and_ends_when_nothing_comes(expiring_sessions_app):
    """The caller sends nothing after its chunk: past the idle timeout and open_timeout_s more, the
    replica sends `session_expired` naming the frames decoded and closes the connection."""
    z = latents(1, seed=4)
    with connect(ws_url(expiring_sessions_app)) as ws:
        send(ws, "open", {"height": H, "width": W})
        receive(ws)
        chunk_answer(ws, z, 0)
        error = receive(ws, timeout=60)["error"]
        assert (error["type"], error["frames"], error["latent_frames"]) == ("session_expired", 1, 1), error
        with pytest.raises(ConnectionClosed):
            receive(ws)
    wait_until(lambda: connections(expiring_sessions_app, 1) == 0, 60, "its connection given back")


@pytest.mark.parametrize("transport", ["websocket", "grpc"])
def test_a_caller_gone_mid_chunk_stops_it_and_frees_its_session(sessions_app, grpc_target, transport):
    """The caller leaves (a closed WebSocket, a cancelled DecodeSession call) while its chunk of 4
    latent frames decodes: the chunk stops (no session took it: the replicas' chunk count stays) and
    the session is freed, the idle timeout (300 s) having nothing to do with it."""
    import grpc

    from vae_service_client.grpc_gen import decode_pb2_grpc
    from vae_service_client.session_proto import request_proto

    z = np.random.default_rng(6).standard_normal((1, C, 4, 64, 64)).astype(np.float32)
    chunks_before = sum(h["sessions"]["chunks"] for h in replica_health(sessions_app, 2).values())

    def decoding() -> bool:
        return any(h["running_batches"] for h in replica_health(sessions_app, 2).values())

    if transport == "websocket":
        ws = connect(ws_url(sessions_app))
        send(ws, "open", {"height": 64, "width": 64})
        assert "opened" in receive(ws)
        send(ws, "chunk", {"latents": latents_map(z), "latent_frame": 0})
        wait_until(decoding, 60, "the chunk decoding")
        ws.close()
    else:
        channel = grpc.insecure_channel(grpc_target)
        requests = [
            request_proto({"open": {"height": 64, "width": 64}}),
            request_proto({"chunk": {"latents": latents_map(z), "latent_frame": 0}}),
        ]
        held = threading.Event()

        def stream():
            yield from requests
            held.wait(120)  # the caller's side stays open until it cancels

        stub = decode_pb2_grpc.VaeDecoderStub(channel)
        replies = stub.DecodeSession(stream(), metadata=(("application", "sessions"),), timeout=120)
        assert next(replies).WhichOneof("kind") == "opened"
        wait_until(decoding, 60, "the chunk decoding")
        replies.cancel()
        held.set()
        channel.close()
    wait_until(lambda: sessions_open(sessions_app) == 0, 60, "the session freed")
    wait_until(lambda: not decoding(), 60, "the device idle")
    assert sum(h["sessions"]["chunks"] for h in replica_health(sessions_app, 2).values()) == chunks_before


def test_high_sessions_batch_across_sessions(sessions_app):
    """Several `high` sessions sending at once decode in shared decoder calls (batch_size > 1 on
    some chunk), each within the fast path's bound of its own whole lossless decode."""
    n, chunks = 3, 3
    zs = [latents(chunks, seed=20 + i) for i in range(n)]
    results: list = [None] * n

    def run(i: int) -> None:
        with connect(ws_url(sessions_app)) as ws:
            send(ws, "open", {"height": H, "width": W, "quality": "high", "output": "float"})
            receive(ws)
            frames, sizes = [], []
            for k in range(chunks):
                messages, done = chunk_answer(ws, zs[i][:, :, k : k + 1], k)
                frames.append(np.concatenate([decode_tensor(m["pixels"], "pixels").to_numpy() for m in messages], 2))
                sizes.append(done["chunk_done"]["timing"]["batch_size"])
            results[i] = (np.concatenate(frames, axis=2), sizes)

    async def all_at_once():
        await asyncio.gather(*(asyncio.to_thread(run, i) for i in range(n)))

    asyncio.run(all_at_once())
    for i, (frames, _) in enumerate(results):
        whole = whole_answer(sessions_app, zs[i], output="float")
        assert np.abs(frames - whole).max() <= 1e-3
    assert max(size for _, sizes in results for size in sizes) > 1


def test_handles_pin_a_session_to_its_replica_and_a_killed_replica_answers_session_lost(sessions_app):
    from ray import serve

    from vae_service_client import SessionLost

    handle = serve.get_app_handle("sessions")
    z = latents(4, seed=11)
    opened = handle.open_session.remote(height=H, width=W).result()
    sid = opened["session"]
    pinned = handle.options(session_id=sid)
    frames = []
    for k in range(4):  # every chunk must reach the replica that holds the session
        answer = pinned.decode_chunk.remote(sid, z[:, :, k : k + 1], latent_frame=k).result()
        assert answer["frame"] == sum(f.shape[1] for f in frames)
        frames.append(answer["pixels"])
    np.testing.assert_array_equal(np.concatenate(frames, axis=1), whole_answer(sessions_app, z))
    kill_owner(sid)
    deadline = time.monotonic() + 30
    while True:
        try:
            pinned.decode_chunk.remote(sid, z[:, :, :1], latent_frame=4).result()
        except SessionLost as lost:
            assert lost.type == "session_lost" and lost.status == 503
            break
        except Exception:  # the killed replica's calls in flight fail with Ray's error until Serve notices
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert pinned.close_session.remote(sid).result() is None


def test_the_ray_actor_decodes_a_session(ray_cluster, wan_dir):
    from vae_service.ray import DecoderActor

    actor = DecoderActor.remote({"model": str(wan_dir), "cpu_threads": 1})
    try:
        z = latents(3, seed=5)
        sid = ray.get(actor.open_session.remote(height=H, width=W, output="float"))["session"]
        parts = [ray.get(actor.decode_chunk.remote(sid, z[:, :, k : k + 1], k))["pixels"] for k in range(3)]
        whole = ray.get(actor.decode.remote(z, output="float"))["output"]
        np.testing.assert_array_equal(np.concatenate(parts, axis=2), whole)
        assert ray.get(actor.close_session.remote(sid)) == {"frames": 9, "latent_frames": 3}
    finally:
        ray.kill(actor)


@pytest.mark.parametrize("output", ["mp4", "webm"])
def test_a_browser_plays_a_session_while_its_chunks_are_still_being_sent(sessions_app, output):
    """Chromium's MediaSource gets the session's fragments as each chunk is decoded; the relay holds
    the rest after the first fragment until the browser buffered it, and only then is the next chunk
    sent: the browser played frames of a session whose later latents did not exist yet."""
    require_chromium()
    latent_frames = 4
    z = latents(latent_frames, seed=9)
    sent = []

    def fragments(ws):
        for k in range(latent_frames):
            sent.append(time.monotonic())
            messages, done = chunk_answer(ws, z[:, :, k : k + 1], k)
            assert "chunk_done" in done, done
            yield from (m["fragment"] for m in messages)
        send(ws, "close", {})
        closed = receive(ws)["closed"]
        yield closed["trailer"]  # the closing box (element) holding the summary, as a streamed answer ends

    @contextlib.contextmanager
    def source():
        with connect(ws_url(sessions_app)) as ws:
            send(ws, "open", {"height": H, "width": W, "output": output})
            receive(ws)
            media = fragments(ws)
            first = next(media)
            codecs = avc1_codecs(first) if output == "mp4" else "vp9"
            yield f'video/{output}; codecs="{codecs}"', itertools.chain([first], media)

    with browser_page(source) as page:
        assert page.wait_for("type")["supported"], page.explain()
        buffered = page.wait_for("buffered", timeout=60)
        ended = page.wait_for("ended", timeout=60)
        assert page.find("failure") is None, page.explain()
        relay = page.relay
    fps = Encoding().mp4_fps  # mp4 and webm alike
    assert buffered["open"], page.explain()
    assert relay.held_at <= buffered["received_at"] <= relay.released_at, page.explain()
    assert len(sent) == latent_frames and sent[1] >= relay.released_at - 1.0  # chunk 2 went after the hold
    assert abs(ended["duration"] - (1 + 4 * (latent_frames - 1)) / fps) < 0.5 / fps, page.explain()


# ---- the client library (vae_service_client: VaeClient.session, AsyncVaeClient.session) ---------
def test_the_client_decodes_a_session_chunk_by_chunk_exactly(sessions_app, tmp_path):
    """Sync: frames after every chunk, joined = the whole answer bit for bit; mp4 with `path`: the
    file grows by each chunk's fragment, the joined fragments are the file."""
    z = latents(5, seed=31)
    with VaeClient(sessions_app).session(H, W) as session:
        parts = [session.decode(z[:, :, a:b]) for a, b in ((0, 1), (1, 3), (3, 5))]
        assert [p.frame for p in parts] == [0, 1, 9] and [p.frames for p in parts] == [1, 8, 8]
        assert session.frames == 17 and session.latent_frames == 5 and session.session_id
    assert session.closed == {"frames": 17, "latent_frames": 5}
    np.testing.assert_array_equal(np.concatenate([p.pixels for p in parts], axis=1), whole_answer(sessions_app, z))
    path, sizes = tmp_path / "session.mp4", []
    with VaeClient(sessions_app).session(H, W, output="mp4", path=path) as session:
        for part in session.iter_decode([z[:, :, :2], z[:, :, 2:]]):
            assert part.pixels is None and part.fragment
            sizes.append(path.stat().st_size)
    assert sizes[0] < sizes[1] == path.stat().st_size


def test_the_async_client_decodes_a_session_exactly(sessions_app):
    from vae_service_client import AsyncVaeClient

    z = latents(4, seed=32)

    async def run():
        async with AsyncVaeClient(sessions_app) as client, client.session(H, W, output="float") as session:
            return [part.pixels async for part in session.iter_decode(z[:, :, k : k + 1] for k in range(4))]

    parts = asyncio.run(run())
    np.testing.assert_array_equal(np.concatenate(parts, axis=2), whole_answer(sessions_app, z, output="float"))


def test_a_lost_session_resumes_in_the_client_with_the_same_frames(sessions_app):
    """The replica holding the session killed between chunks: with resume=True the next chunk's
    answer continues the frames (the kept latents replayed on another replica, their frames not
    handed out again); without it, SessionLost names the last frame received."""
    from vae_service_client import SessionLost

    z = latents(5, seed=33)
    with VaeClient(sessions_app).session(H, W, resume=True) as session:
        first = session.decode(z[:, :, :2])
        lost_id = session.session_id
        kill_owner(lost_id)
        rest = [session.decode(z[:, :, 2:4]), session.decode(z[:, :, 4:])]
        assert session.resumes == 1 and session.session_id != lost_id
        assert session.kept_bytes >= z[:, :, :4].nbytes
    assert [p.frame for p in (first, *rest)] == [0, 5, 13]
    joined = np.concatenate([p.pixels for p in (first, *rest)], axis=1)
    np.testing.assert_array_equal(joined, whole_answer(sessions_app, z))
    with VaeClient(sessions_app).session(H, W) as session:
        session.decode(z[:, :, :1])
        kill_owner(session.session_id)
        with pytest.raises(SessionLost, match="after frame 0"):
            session.decode(z[:, :, 1:2])


def test_an_expired_session_raises_or_resumes_in_the_client(expiring_sessions_app):
    from vae_service_client import SessionExpired

    sessions_app = expiring_sessions_app
    z = latents(2, seed=34)
    with VaeClient(sessions_app).session(H, W, output="float", resume=True) as session:
        first = session.decode(z[:, :, :1])
        time.sleep(3.0)  # idle_timeout_s 1.5
        second = session.decode(z[:, :, 1:])
        assert session.resumes == 1
    joined = np.concatenate([first.pixels, second.pixels], axis=2)
    np.testing.assert_array_equal(joined, whole_answer(sessions_app, z, output="float"))
    with pytest.raises(SessionExpired, match="1 frames"), VaeClient(sessions_app).session(H, W) as session:
        session.decode(z[:, :, :1])
        time.sleep(3.0)
        session.decode(z[:, :, 1:])


def test_the_cli_replays_a_latent_file_as_session_chunks(sessions_app, tmp_path):
    import subprocess
    import sys

    from PIL import Image

    z = latents(3, seed=35)
    np.save(tmp_path / "clip.npy", z)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "vae_service.cli", "decode", str(tmp_path / "clip.npy"), "--chunks", "2",
         "--url", sessions_app, "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "latent frames 0-1: frames 0-4" in done.stdout and "latent frames 2-2: frames 5-8" in done.stdout
    pngs = sorted(out.glob("clip-frame*.png"))
    frames = np.stack([np.asarray(Image.open(p)) for p in pngs])
    np.testing.assert_array_equal(frames, whole_answer(sessions_app, z)[0])


# ---- gRPC: VaeDecoder.DecodeSession, the same conversation in protobuf --------------------------
def test_a_grpc_session_decodes_exactly_refuses_bad_chunks_and_resumes_a_lost_replica(sessions_app, grpc_target):
    """The sync gRPC client: frames after every chunk, joined = the whole answer bit for bit; a bad
    chunk answered in the stream (the session goes on exactly); a refused open typed, naming the
    field; the replica killed between chunks resumed with the same frames; a session abandoned
    (the call cancelled) freed at once."""
    from vae_service_client import InvalidRequest, SessionLost, VaeGrpcClient

    z = latents(5, seed=41)
    whole = whole_answer(sessions_app, z)
    with VaeGrpcClient(grpc_target, application="sessions") as client:
        with client.session(H, W) as session:
            first = session.decode(z[:, :, :2])
            with pytest.raises(InvalidRequest, match="latents") as refused:
                session.decode(np.zeros((1, C + 1, 1, H, W), np.float32))
            assert refused.value.field.startswith("latents")
            rest = session.decode(z[:, :, 2:])
        assert (first.frame, first.frames, rest.frame, rest.frames) == (0, 5, 5, 12)
        assert session.closed == {"frames": 17, "latent_frames": 5}
        np.testing.assert_array_equal(np.concatenate([first.pixels, rest.pixels], axis=1), whole)

        with pytest.raises(InvalidRequest) as refused:
            client.session(H, W, quality="preview")
        assert refused.value.field == "quality"

        with client.session(H, W, resume=True) as session:
            parts = [session.decode(z[:, :, :2])]
            kill_owner(session.session_id)
            parts.append(session.decode(z[:, :, 2:]))
            assert session.resumes == 1
        np.testing.assert_array_equal(np.concatenate([p.pixels for p in parts], axis=1), whole)
        with client.session(H, W) as session:
            session.decode(z[:, :, :1])
            kill_owner(session.session_id)
            with pytest.raises(SessionLost, match="after frame 0"):
                session.decode(z[:, :, 1:2])

        wait_until(lambda: sessions_open(sessions_app) == 0, 60, "the killed replicas' successors up")
        with pytest.raises(RuntimeError), client.session(H, W) as session:
            session.decode(z[:, :, :1])
            assert sessions_open(sessions_app) == 1
            raise RuntimeError("the caller's own failure: the call is cancelled, no close sent")
    wait_until(lambda: sessions_open(sessions_app) == 0, 60, "the cancelled call's session freed")


def test_a_grpc_stream_ends_a_refused_session_with_the_errors_status(grpc_target, sessions_app):
    """A bare stub: an open refused is the stream's last reply and its status (code and trailers, as
    every RPC's), so a caller without this client reads it the usual way."""
    import grpc

    from vae_service_client.grpc_gen import decode_pb2, decode_pb2_grpc

    with grpc.insecure_channel(grpc_target) as channel:
        stub = decode_pb2_grpc.VaeDecoderStub(channel)
        requests = iter([decode_pb2.SessionRequest(open=decode_pb2.SessionOpen(height=H))])
        replies = stub.DecodeSession(requests, metadata=(("application", "sessions"),), timeout=60)
        seen = []
        with pytest.raises(grpc.RpcError) as ended:
            for reply in replies:
                seen.append(reply)
        assert [reply.WhichOneof("kind") for reply in seen] == ["error"] and seen[0].error.field == "width"
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailers = dict(ended.value.trailing_metadata())
        assert (trailers["error-type"], trailers["error-field"]) == ("invalid_request", "width")


def test_the_async_grpc_client_streams_a_sessions_mp4_as_the_websocket_does(sessions_app, grpc_target):
    from vae_service_client import AsyncVaeGrpcClient

    z = latents(3, seed=42)
    with VaeClient(sessions_app).session(H, W, output="mp4") as session:
        over_ws = b"".join(session.decode(z[:, :, a:b]).fragment for a, b in ((0, 1), (1, 3)))
        ws_trailer = session.close()["trailer"]

    async def run():
        async with AsyncVaeGrpcClient(grpc_target, application="sessions") as client:
            async with client.session(H, W, output="mp4") as session:
                parts = [await session.decode(z[:, :, a:b]) for a, b in ((0, 1), (1, 3))]
            return parts, session.closed

    parts, closed = asyncio.run(run())
    assert [p.frame for p in parts] == [0, 1] and parts[0].fragment.startswith(over_ws[:8])
    assert b"".join(p.fragment for p in parts) == over_ws
    assert closed["frames"] == 9 and closed["trailer"][:8] == ws_trailer[:8]


def test_a_sessions_chunks_go_between_the_steps_of_a_bulk_video_on_their_replica(expiring_sessions_app):
    """One replica: a bulk /decode of a 40-latent-frame clip runs; a session opened meanwhile sends
    three chunks, each answered before the clip (each waits at most one of its latent frames). The
    clip, suspended between its frames, says for how long and is the bits of its decode alone."""
    url, clip = expiring_sessions_app, latents(40, seed=11)
    client = VaeClient(url)
    with ThreadPoolExecutor(1) as pool:
        bulk = pool.submit(client.decode, clip, output="float", priority="bulk")
        wait_until(lambda: started_batches(url) > 0 or bulk.done(), 60, "the clip on the device")
        with connect(ws_url(url)) as ws:
            send(ws, "open", {"height": H, "width": W})
            assert "opened" in receive(ws)
            z = latents(3, seed=12)
            for t in range(3):
                _, done = chunk_answer(ws, z[:, :, t : t + 1], t)
                assert "chunk_done" in done, done
                assert not bulk.done(), f"the clip finished before chunk {t} was answered"
        answer = bulk.result(120)
    assert answer.timing["preempted_ms"] > 0
    assert np.array_equal(answer.output, client.decode(clip, output="float", priority="bulk").output)
    (health,) = replica_health(url, 1).values()
    classes = health["scheduling"]["classes"]
    assert classes["bulk"]["preemptions"] >= 3 and classes["realtime"]["batches"] >= 3


def started_batches(url: str) -> int:
    (health,) = replica_health(url, 1).values()
    return health["scheduling"]["started_batches"]


def test_a_viewer_landing_on_another_replica_is_relayed_the_sessions_own_stream(sessions_app):
    """Serve's proxy may send a viewer to a replica without the session (a browser's WebSocket sets
    no routing header): that replica relays the stream from the session's replica. The landing is
    forced here by the proxy's own `x-session-id` routing; the relayed viewer gets what the
    session's own viewer gets, byte for byte, and a wrong token is refused alike there and here."""
    ws, opened = open_session(sessions_app, frames="none", watch=True)
    session, token = opened["opened"]["watch"]["id"], opened["opened"]["watch"]["token"]  # the watch id
    owner = session.split(".", 1)[0]
    (other,) = set(replica_health(sessions_app, 2)) - {owner}
    at_home = StreamViewer(sessions_app, session, token, **{"x-session-id": session})
    relayed = StreamViewer(sessions_app, session, token, **{"x-session-id": f"{other}.viewer"})
    refusals = []
    for landing in (owner, other):
        try:
            StreamViewer(sessions_app, session, "A" * 43, **{"x-session-id": f"{landing}.viewer"})
        except InvalidStatus as refused:
            refusals.append((refused.response.status_code, refused.response.body))
    readers = [viewer.read_meanwhile() for viewer in (at_home, relayed)]
    left = StreamViewer(sessions_app, session, token, **{"x-session-id": f"{other}.viewer"})
    left.ws.close()  # a relayed viewer that leaves is let go on the session's replica too
    wait_until(
        lambda: replica_health(sessions_app, 2)[owner]["viewers"]["viewers"] == 2, 30, "the relay that left, let go"
    )
    send(ws, "chunk", {"latents": latents_map(latents(2, 31)), "latent_frame": 0})
    receive(ws)
    health = replica_health(sessions_app, 2)
    send(ws, "chunk", {"latents": latents_map(latents(1, 32)), "latent_frame": 2})
    receive(ws)
    send(ws, "close", {})
    closed = receive(ws)["closed"]
    for reader in readers:
        reader.join(60)
    ws.close()
    assert health[other]["viewers"]["relayed_viewers"] == 1 and health[owner]["viewers"]["viewers"] == 2
    assert at_home.ended["reason"] == relayed.ended["reason"] == "closed"
    assert relayed.start == at_home.start and relayed.file() == at_home.file()
    assert len(relayed.data) == closed["latent_frames"]  # one fragment per latent frame, none dropped
    assert len(refusals) == 2 and refusals[0] == refusals[1] and refusals[0][0] == 401


def test_a_grpc_session_asking_no_frames_is_watched_over_http(sessions_app, grpc_target):
    """The open options and opened.watch cross gRPC (`DecodeSession`) as the WebSocket's: the
    denoiser's chunks answer only their counts, the viewer gets the session's file."""
    from vae_service_client import VaeGrpcClient

    app = sessions_app.rstrip("/").rsplit("/", 1)[1].removesuffix("-app")
    with (
        VaeGrpcClient(grpc_target, application=app, http_base_url=sessions_app) as client,
        client.session(H, W, output="webm", frames="none", watch=True) as session,
    ):
        watch = session.watch
        assert watch.url == f"{sessions_app}/watch/{watch.id}#token={watch.token}"
        viewer = StreamViewer(sessions_app, watch.id, watch.token, **{"x-session-id": watch.id})
        reading = viewer.read_meanwhile()
        parts = [session.decode(latents(t, 40 + t)) for t in (2, 1)]
    reading.join(60)
    assert [p.pixels for p in parts] == [None, None] and [p.fragment for p in parts] == [b"", b""]
    assert viewer.ended["reason"] == "closed" and viewer.start["content_type"].startswith("video/webm")
    assert len(viewer.data) == 3 and viewer.ended["frames"] == session.frames
