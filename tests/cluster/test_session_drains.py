"""Live decode sessions through what an autoscaled cluster does to replicas, on the fake multi-node
cluster (conftest.py: a node per replica; deploy/serve-gpu.yaml with the decoder's own autoscaling
policy, its targets on the test's time scale):

- idle sessions (each an open WebSocket: one of Serve's ongoing requests for its whole life) under
  the room's target leave the deployment at one replica over several policy periods, where Serve's
  default policy at the yaml's test `target_ongoing_requests: 2` would want one per two sockets
  (the unit tests run Serve's own default policy beside ours);
- a ramp of sessions fills the first replica's session room past the policy's target: a second
  replica (on a second node) is added; sessions opened then are placed on it (the first is full);
- sessions closed leave room for the rest on one replica: the policy scales down, the replica Serve
  stops drains, and its live sessions move to the other through the session keeper (on the head
  node): every session's frames joined are the whole decode's, no latent frame sent twice;
- a rolling update (`serve deploy` of changed arguments) moves every live session again, exactly;
- the node of a session's replica killed: the session goes on from its latest checkpoint, its
  client sending again only the chunks after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from tests.cluster.conftest import FakeCluster, serve_gpu_config, wait_for
from tests.cluster.test_multi_node import deployed
from tests.session_wire import C, H, W
from vae_service.config import ServiceConfig
from vae_service.engine import DecodeEngine
from vae_service.engine.request.session import SessionOpen
from vae_service_client import VaeClient

pytestmark = pytest.mark.cluster
ROOM_FOR = 4.5  # sessions' caches a replica's session budget holds: 4 are over the policy's 0.8 of it
CHUNKS = 7  # one latent frame each
EVERY = 3  # a checkpoint every 3 chunks
WATCH_S = 6.0  # three look-back periods (2 s) of six upscale delays (1 s)


def session_config(cluster: FakeCluster, wan_dir, idle_timeout_s: float = 300) -> dict:
    held = DecodeEngine(ServiceConfig(model=str(wan_dir), device="cpu", decode_precision="fp32"))
    price = held.open_session("probe", SessionOpen(H, W)).held_price
    return serve_gpu_config(
        wan_dir,
        cluster.http_port,
        cluster.grpc_port,
        model_name="wan",
        limits={"max_session_bytes": int(ROOM_FOR * price), "body_timeout_s": 3},
        sessions={"idle_timeout_s": idle_timeout_s, "checkpoint_every_chunks": EVERY},
    )


class Clip:
    """A session and its latents, fed one latent frame a chunk; its frames kept."""

    def __init__(self, client: VaeClient, seed: int, resume: bool = False):
        self.z = np.random.default_rng(seed).standard_normal((1, C, CHUNKS, H, W)).astype(np.float32)
        self.session, self.frames, self.sent = client.session(H, W, resume=resume), [], 0

    @property
    def owner(self) -> str:
        return self.session.session_id.split(".", 1)[0]

    def feed(self, chunks: int = 1) -> None:
        for _ in range(chunks):
            self.frames.append(self.session.decode(self.z[:, :, self.sent : self.sent + 1]).pixels)
            self.sent += 1

    def finish(self, client: VaeClient) -> None:
        self.feed(CHUNKS - self.sent)
        self.session.close()
        np.testing.assert_array_equal(np.concatenate(self.frames, axis=1), client.decode(self.z).output)


def test_sessions_ramp_up_scale_down_and_roll_without_replay_and_a_lost_node_costs_a_checkpoints_chunks(
    fake_cluster: FakeCluster, wan_dir
):
    cluster = fake_cluster
    config = session_config(cluster, wan_dir)
    (first_replica,) = deployed(cluster, config)
    with VaeClient(cluster.url, timeout=120) as client:
        ramp = [Clip(client, seed) for seed in range(3)]  # 3 idle sockets, under 0.8 of the room
        ramp[0].feed()
        seen, deadline = set(), time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            seen.add(len(cluster.replicas()))
            time.sleep(0.25)
        assert seen == {1}, seen
        ramp.append(Clip(client, 3))  # past 0.8 of the room: a second replica
        for clip in ramp[1:]:
            clip.feed()
        assert {clip.owner for clip in ramp} == {first_replica}
        wait_for("a second replica for the sessions' room", lambda: len(cluster.replicas()) == 2, 240)
        later = [Clip(client, seed) for seed in (10, 11)]  # the first replica's room is full: the second
        for clip in later:
            clip.feed()
        assert all(clip.owner != first_replica for clip in later)
        for clip in ramp[1:]:  # 3 sessions left, under 0.8 of one replica's room: one replica goes
            clip.session.close()
        live = [ramp[0], *later]
        for clip in live:
            clip.feed()
        wait_for("down to one replica", lambda: len(cluster.replicas()) == 1, 120)
        for clip in live:
            clip.feed()
        assert sum(clip.session.attaches for clip in live) >= 1  # the replica that went held some

        (app,) = config["applications"]  # a rolling update: every replica replaced
        app["args"]["sessions"]["idle_timeout_s"] = 299
        before = set(cluster.replicas())
        cluster.deploy(config)

        def rolled() -> bool:
            running = set(cluster.replicas())
            return bool(running) and not running & before and cluster.app_status() == "RUNNING"

        wait_for("the update rolled out", rolled, 180)
        for clip in live:
            clip.feed()
            assert clip.session.replayed_latent_frames == 0
        for clip in live:
            clip.finish(client)
        assert all(clip.session.attaches >= 1 for clip in live)

        lost = Clip(client, 20, resume=True)  # 4 chunks: a checkpoint after the third
        lost.feed(4)
        replica = lost.session.session_id.split(".", 1)[0]
        node = wait_for("its checkpoint", lambda: client.health()["sessions"]["checkpoints"] >= 1 and
                        cluster.replicas().get(replica), 30)  # fmt: skip
        for pid in cluster.node_pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for("a replica on another node", lambda: set(cluster.replicas()) - {replica}, 240)
        lost.finish(client)
        assert lost.session.attaches == 1 and lost.session.replayed_latent_frames == 1  # the 4th chunk
