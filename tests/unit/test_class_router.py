"""The decode deployment's request router by class (serving/scheduling/class_router.py), on Serve's
own request and replica objects: the class a call shows before its body, and the replicas ranked by
the work that class would wait behind, from each replica's routing stats (DecodeService.routing_stats)."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID, RequestMetadata, RunningReplicaInfo
from ray.serve._private.request_router.common import PendingRequest

from vae_service.serving.scheduling.class_router import ranked, request_class

DEPLOYMENT = DeploymentID(name="VaeDecoder", app_name="vae")


def replica(name: str, stats: dict | None) -> RunningReplicaInfo:
    """What the router reads of a replica (a RunningReplica wraps this, and needs its live actor)."""
    return RunningReplicaInfo(
        ReplicaID(name, DEPLOYMENT), "node", "127.0.0.1", None, f"actor-{name}", 32, routing_stats=stats or {}
    )


def call(method: str = "__call__", route: str = "", grpc: str = "", **kwargs) -> PendingRequest:
    metadata = RequestMetadata("r", "r", call_method=method, route=route, _grpc_service_method=grpc)
    return PendingRequest([], kwargs, metadata)


@pytest.mark.parametrize(
    "pending, expected",
    [
        (call(), "interactive"),
        (call("decode", priority="bulk"), "bulk"),
        (call("decode", priority="realtime"), "realtime"),  # the replica refuses a claim above its limit
        (call("decode", priority="urgent"), "interactive"),  # not a class: the surface's default
        (call("open_session"), "realtime"),
        (call(route="/sessions"), "interactive"),  # a WebSocket: Serve gives it no route name to go by
        (call(grpc="/vae.VaeDecoder/DecodeSession"), "realtime"),
        (call(grpc="/vae.VaeDecoder/Decode"), "interactive"),
        (None, "interactive"),
    ],
)
def test_the_class_a_call_shows_before_its_body(pending, expected):
    assert request_class(pending) == expected


def items(realtime: int = 0, interactive: int = 0, bulk: int = 0) -> dict:
    return {"items": {"realtime": realtime, "interactive": interactive, "bulk": bulk}}


def names(ranks) -> list[str]:
    return [r.replica_id.unique_id for (r,) in ranks]


def test_realtime_work_goes_where_the_least_realtime_work_waits_and_bulk_where_the_least_work_waits():
    sessions_busy = replica("a", items(realtime=3))  # live sessions' chunks
    bulk_busy = replica("b", items(bulk=40))  # a batch job
    idle_ish = replica("c", items(interactive=1))
    replicas = [sessions_busy, bulk_busy, idle_ish]
    # a new session waits behind realtime work only (the rest is preempted for it); then the least work
    assert names(ranked(replicas, "realtime")) == ["c", "b", "a"]
    # bulk runs in the gaps: where there is the least work of any class
    assert names(ranked(replicas, "bulk")) == ["c", "a", "b"]


def test_replicas_without_stats_or_all_alike_are_left_to_serves_default():
    assert ranked([replica("a", items(bulk=1)), replica("b", None)], "interactive") is None
    assert ranked([replica("a", items(interactive=2)), replica("b", items(interactive=2))], "bulk") is None
