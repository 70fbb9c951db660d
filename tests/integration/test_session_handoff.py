"""Live decode sessions across the ways a replica goes, on real replicas (tiny causal Wan):

- a scale-down and a rolling update: every session on a draining replica moves through the session
  keeper, its client (WebSocket, gRPC, a handle's caller) continues it on another replica, and the
  frames joined are the whole decode's, bit for bit, with no latent frame sent twice; an mp4
  session's file is byte for byte the file of a session that never moved;
- a replica killed: its sessions go on from their latest checkpoint, the client sending again only
  the chunks after it (and keeping only those).

The replica count is a test's to set (tests/replicas_from_file.py: an autoscaling policy reading it
from a file), so a scale-down is Serve draining the replicas it removes, as for any policy's
decision; `serve.run` of the application again rolls every replica (a new code version)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.conftest import SESSIONS_CONFIG, TEST_DEPLOYMENT
from tests.session_wire import H, W, decoded_video, kill_owner, latents, whole_answer
from tests.watch_clients import StreamViewer
from vae_service_client import VaeClient, VaeGrpcClient

pytestmark = pytest.mark.integration
APP = "handoff"
CHUNKS = [1, 1, 2, 1, 1]  # latent frames per chunk
EVERY = 2  # a checkpoint every 2 chunks


def deploy(wan_dir, count_file: Path, replicas: int = 2) -> None:
    """The application (again: every replica rolled), with `replicas` replicas."""
    from ray import serve

    from vae_service.serving.app import decoder_app

    # room on one replica for every session of a test (an attach over the room is refused: the unit
    # test_session_conversation.py::test_a_session_taken_in_is_priced_in_the_room_like_an_open)
    config = {
        **SESSIONS_CONFIG,
        "model": str(wan_dir),
        "limits": {"max_sessions": 8, "max_session_chunk_frames": 4},
        "serving": {"concurrent_keys": 5},
        "sessions": {
            "idle_timeout_s": 300,
            "open_timeout_s": 30,
            "checkpoint_every_chunks": EVERY,
            "max_connections": 8,
        },
    }
    count_file.write_text(str(replicas))
    policy = {
        "policy_function": "tests.replicas_from_file:ReplicasFromFile",
        "policy_kwargs": {"path": str(count_file)},
    }
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "initial_replicas": replicas,
        "policy": policy,
        "upscale_delay_s": 0.1,  # Serve delays a custom policy's decisions too (600 s to scale down by default)
        "downscale_delay_s": 0.1,
    }
    # a drain long enough to hand sessions on (the suite's 0.5 s is for apps without sessions)
    options = dict(TEST_DEPLOYMENT, graceful_shutdown_timeout_s=30, autoscaling_config=autoscaling)
    serve.run(decoder_app(config, ray_actor_options={"num_cpus": 0}, **options), name=APP, route_prefix=f"/{APP}-app")
    wait_for_replicas(replicas)


def scale(count_file: Path, replicas: int) -> None:
    """Serve's autoscaler takes the deployment to `replicas` (draining the ones it removes)."""
    count_file.write_text(str(replicas))
    wait_for_replicas(replicas)


def wait_for_replicas(replicas: int, timeout_s: float = 120) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications[APP]
        deployment = next(iter(status.deployments.values()))
        running = deployment.replica_states.get("RUNNING", 0)
        if status.status == "RUNNING" and running == replicas and sum(deployment.replica_states.values()) == replicas:
            return
        assert time.monotonic() < deadline, f"{APP}: {deployment.replica_states}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def count_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("handoff") / "replicas"


@pytest.fixture(scope="module")
def deployed_app(ray_cluster, wan_dir, count_file):
    from ray import serve

    deploy(wan_dir, count_file)
    yield f"{ray_cluster}/{APP}-app"
    serve.delete(APP)


@pytest.fixture
def handoff_app(deployed_app, count_file):
    """The application with its two replicas (a test before may have left one)."""
    scale(count_file, 2)
    return deployed_app


@pytest.fixture
def redeploy(wan_dir, count_file):
    return lambda: deploy(wan_dir, count_file)


class Live:
    """Sessions of every kind a client holds, each over its own latents, fed chunk by chunk."""

    def __init__(self, url: str, grpc_target: str):
        from ray import serve

        self.url, self.handle = url, serve.get_app_handle(APP)
        self.clients = [VaeClient(url), VaeGrpcClient(grpc_target, application=APP)]
        self.sessions, self.frames, self.z = [], [], []
        self.handle_sid, self.handle_frames = None, []

    def open(self, count: int) -> None:
        """`count` client sessions, alternately WebSocket and gRPC, plus one handle session; opened
        until both replicas hold at least one."""
        owners: set[str] = set()
        while len(self.sessions) < count or len(owners) < 2:
            assert len(self.sessions) < 4 * count, f"sessions all opened on {owners}"
            client = self.clients[len(self.sessions) % 2]
            session = client.session(H, W)
            owners.add(session.session_id.split(".", 1)[0])
            self.sessions.append(session)
            self.frames.append([])
            self.z.append(latents(sum(CHUNKS), seed=100 + len(self.z)))
        opened = self.handle.open_session.remote(height=H, width=W).result()
        self.handle_sid = opened["session"]
        self.handle_z = latents(sum(CHUNKS), seed=99)

    def feed(self, chunks: range) -> None:
        for k in chunks:
            start, t = sum(CHUNKS[:k]), CHUNKS[k]
            for i, session in enumerate(self.sessions):
                self.frames[i].append(session.decode(self.z[i][:, :, start : start + t]).pixels)
            answer = self._handle_chunk(self.handle_z[:, :, start : start + t], start)
            self.handle_frames.append(answer["pixels"])

    def _handle_chunk(self, z, start: int) -> dict:
        from vae_service_client import SessionMoved

        pinned = self.handle.options(session_id=self.handle_sid)
        for _ in range(50):  # a call that reached the draining replica before Serve stopped routing there
            try:
                return pinned.decode_chunk.remote(self.handle_sid, z, latent_frame=start).result()
            except SessionMoved:
                time.sleep(0.1)
        raise AssertionError("the handle's session never settled on a replica")

    def check_exact(self) -> None:
        for i, session in enumerate(self.sessions):
            session.close()
            np.testing.assert_array_equal(np.concatenate(self.frames[i], axis=1), whole_answer(self.url, self.z[i]))
            assert session.replayed_latent_frames == 0 and session.resumes == 0
        handle_whole = whole_answer(self.url, self.handle_z)
        np.testing.assert_array_equal(np.concatenate(self.handle_frames, axis=1), handle_whole)
        self.handle.options(session_id=self.handle_sid).close_session.remote(self.handle_sid).result()

    def close(self) -> None:
        for client in self.clients:
            client.close()


@pytest.mark.parametrize("event", ["scale-down", "rolling update"])
def test_sessions_cross_a_drain_exactly_without_replaying_a_latent_frame(
    handoff_app, grpc_target, redeploy, count_file, event
):
    """scale-down: one replica drains, its sessions move to the other; rolling update: every replica
    is replaced, every session moves at least once."""
    live = Live(handoff_app, grpc_target)
    try:
        live.open(4)
        live.feed(range(2))
        if event == "scale-down":
            scale(count_file, 1)
        else:
            redeploy()
        live.feed(range(2, len(CHUNKS)))
        attaches = [s.attaches for s in live.sessions]
        assert sum(attaches) >= 1 if event == "scale-down" else min(attaches) >= 1, attaches
        live.check_exact()
    finally:
        live.close()


def test_an_mp4_sessions_file_crosses_a_drain_as_one_file_of_the_same_frames(handoff_app, redeploy, tmp_path):
    """The file goes on where it was (its init segment, frame times and fragment numbers) on the new
    replica's encoder: one playable file with the unmoved file's frames at the same times, as near
    the decoded pixels (its bits differ from the fragment after the move: an encoder's rate control
    cannot leave its process, so the new one starts afresh, as after a failed encode). Its viewer is
    told `moved`; the same token watches it on its new replica."""
    z = latents(sum(CHUNKS), seed=7)
    client = VaeClient(handoff_app)
    moved, stayed = tmp_path / "moved.mp4", tmp_path / "stayed.mp4"
    with client.session(H, W, output="mp4", path=moved, watch=True) as session:
        token = session.watch.token
        before = StreamViewer(handoff_app, session.watch.id, token)
        reading = before.read_meanwhile()
        for k in range(2):
            session.decode(z[:, :, sum(CHUNKS[:k]) : sum(CHUNKS[: k + 1])])
        redeploy()
        session.decode(z[:, :, sum(CHUNKS[:2]) : sum(CHUNKS[:3])])
        after = StreamViewer(handoff_app, session.watch.id, session.watch.token)
        reading_after = after.read_meanwhile()
        for k in range(3, len(CHUNKS)):
            session.decode(z[:, :, sum(CHUNKS[:k]) : sum(CHUNKS[: k + 1])])
        assert session.attaches >= 1 and session.replayed_latent_frames == 0
    reading.join(60)
    reading_after.join(60)
    assert before.ended["reason"] == "moved" and len(before.data) == sum(CHUNKS[:2])
    assert after.ended["reason"] == "closed" and len(after.data) == sum(CHUNKS[3:])
    assert session.watch.token == token and after.start["content_type"] == before.start["content_type"]
    assert session.watch.id != session.session_id
    with client.session(H, W, output="mp4", path=stayed) as session:
        for k in range(len(CHUNKS)):
            session.decode(z[:, :, sum(CHUNKS[:k]) : sum(CHUNKS[: k + 1])])
    ours, theirs = decoded_video(moved.read_bytes()), decoded_video(stayed.read_bytes())
    truth = whole_answer(handoff_app, z)[0].astype(int)
    assert [t for t, _ in ours] == [t for t, _ in theirs] and len(ours) == len(truth)
    for (_, a), (_, b), frame in zip(ours, theirs, truth, strict=True):
        assert np.abs(a - frame).mean() <= 1.25 * np.abs(b - frame).mean() + 1


def test_a_killed_replicas_session_resumes_from_its_checkpoint_replaying_only_the_chunks_after_it(handoff_app):
    z = latents(sum(CHUNKS), seed=8)
    with VaeClient(handoff_app).session(H, W, resume=True) as session:
        frames = []
        for k in range(4):  # checkpoints after chunks 2 and 4 (latent frames 2 and 5)
            frames.append(session.decode(z[:, :, sum(CHUNKS[:k]) : sum(CHUNKS[: k + 1])]).pixels)
        time.sleep(1.0)  # the checkpoint of chunk 4 is taken in the background
        sid = session.session_id
        kill_owner(sid, APP)
        frames.append(session.decode(z[:, :, sum(CHUNKS[:4]) :]).pixels)
        assert session.session_id == sid and session.attaches == 1  # the same session, continued
        assert session.replayed_latent_frames == 0  # the checkpoint held every chunk it had applied
        assert session.kept_bytes <= z[:, :, 5:].nbytes + 4096  # only what came after the latest checkpoint
    np.testing.assert_array_equal(np.concatenate(frames, axis=1), whole_answer(handoff_app, z))
