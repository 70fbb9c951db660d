"""Object-storage sinks end to end, against a real S3-compatible store (moto's server, tests/s3.py)
read and written by the replicas' pyarrow S3FileSystem: `POST /decode` with a sink stores the
bytes the same request answers without one; a key that would leave the prefix is 400, a store
that stopped 503 naming the sink; batch-decode reads its inputs (files, Parquet) from the store
and writes its outputs there, and after the store stopped mid-job a rerun writes the rest."""

import hashlib
import io
import time

import httpx
import numpy as np
import pytest
import torch

from tests.integration.conftest import TEST_DEPLOYMENT
from tests.s3 import BUCKET, Gate, Silent
from vae_service.batch import run_batch_decode
from vae_service_client import VaeClient
from vae_service_client.messages import MSGPACK, pack, request_map

pytestmark = pytest.mark.integration
DENIED = "vae-denied"


def deny_writes(s3_server, bucket: str) -> None:
    """A bucket whose policy denies every write (moto's server enforces bucket policies)."""
    import json

    import boto3

    client = boto3.client("s3", endpoint_url=f"http://{s3_server.endpoint}", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    statement = {"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": f"arn:aws:s3:::{bucket}/*"}
    client.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Version": "2012-10-17", "Statement": [statement]}))


@pytest.fixture(scope="module")
def local_sink(tmp_path_factory):
    return tmp_path_factory.mktemp("local-sink")


@pytest.fixture(scope="module")
def sinks_app(ray_cluster, kl_dir, s3_server, local_sink):
    """tiny-kl (as the kl_url service) with three sinks: `results` on the store, `gated` on the
    same store through a relay the test can stop, `local` a folder."""
    from ray import serve

    from vae_service.serving.app import decoder_app

    gate, silent = Gate(s3_server.endpoint), Silent()
    http = {"scheme": "http", "retry_attempts": 1, "connect_timeout_s": 1.0}
    deny_writes(s3_server, DENIED)
    config = {
        "model": str(kl_dir),
        "model_name": "kl",
        "cpu_threads": 1,
        "sinks": {
            "results": {"uri": f"s3://{BUCKET}/served", "endpoint_override": s3_server.endpoint, **http},
            "gated": {"uri": f"s3://{BUCKET}/gated", "endpoint_override": gate.endpoint, **http},
            "local": {"uri": str(local_sink)},
            "missing": {"uri": "s3://no-such-bucket/out", "endpoint_override": s3_server.endpoint, **http},
            "denied": {"uri": f"s3://{DENIED}/out", "endpoint_override": s3_server.endpoint, **http},
            "hung": {
                "uri": f"s3://{BUCKET}/hung",
                "endpoint_override": silent.endpoint,
                **http,
                "max_concurrent_writes": 1,
                "write_timeout_s": 3.0,
            },
        },
    }
    serve.run(decoder_app(config, **TEST_DEPLOYMENT), name="sinks", route_prefix="/sinks")
    yield f"{ray_cluster}/sinks", gate
    serve.delete("sinks")
    gate.close()
    silent.close()


def post(url: str, z, **options) -> httpx.Response:
    body = pack(request_map(z, "lossless", "png", **options))
    return httpx.post(f"{url}/decode", content=body, headers={"content-type": MSGPACK}, timeout=60)


def test_a_sink_stores_the_answers_bytes_and_refuses_keys_and_stores_it_cannot_use(sinks_app, s3_server):
    url, gate = sinks_app
    z = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(11))
    with VaeClient(url) as client:
        files = client.decode(z, "lossless", "png").output
        stored = client.decode(z, "lossless", "png", sink="results", key="job-42/frame").output
        assert client.health()["sinks"] == ["denied", "gated", "hung", "local", "missing", "results"]  # names only
    assert stored == [
        {"uri": f"s3://{BUCKET}/served/job-42/frame-{i}.png", "size": len(f), "sha256": hashlib.sha256(f).hexdigest()}
        for i, f in enumerate(files)
    ]
    assert [s3_server.read(f"served/job-42/frame-{i}.png") for i in range(2)] == files
    # a key that would leave the prefix, a sink the deployment does not have: 400 naming them
    for options, field in (({"sink": "results", "key": "../gated/x"}, "key"), ({"sink": "s3", "key": "x"}, "sink")):
        answer = post(url, z, **options)
        assert (answer.status_code, answer.json()["error"]["field"]) == (400, field)
    assert s3_server.listing("gated") == [] and s3_server.listing("served") == [
        f"served/job-42/frame-{i}.png" for i in range(2)
    ]
    # the store stops: 503 naming the sink, with Retry-After, and nothing under the name
    gate.close()
    answer = post(url, z[:1], sink="gated", key="after-stop")
    error = answer.json()["error"]
    assert (answer.status_code, error["type"], error["field"]) == (503, "unavailable", "sink")
    assert "Retry-After" in answer.headers and "sink 'gated'" in error["message"]
    assert s3_server.read("gated/after-stop.png") is None


def test_a_local_sink_never_follows_a_link_out_of_its_folder(sinks_app, local_sink, tmp_path):
    """A link to a folder outside, planted in the sink's folder: a key through it is 400 naming
    `key` and nothing outside changes (no file overwritten, no folder made); a link in place of a
    final name is replaced by the answer's file, inside the sink."""
    url, _ = sinks_app
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.png").write_bytes(b"someone else's file")
    (local_sink / "shared").symlink_to(outside, target_is_directory=True)
    z = torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(12))
    for key in ("shared/victim", "shared/made/dirs/x"):
        answer = post(url, z, sink="local", key=key)
        error = answer.json()["error"]
        assert (answer.status_code, error["field"]) == (400, "key") and "symbolic link" in error["message"], error
    assert sorted(p.name for p in outside.iterdir()) == ["victim.png"]
    assert (outside / "victim.png").read_bytes() == b"someone else's file"
    (local_sink / "frame.png").symlink_to(outside / "victim.png")
    with VaeClient(url) as client:
        png = client.decode(z, "lossless", "png").output[0]
        stored = client.decode(z, "lossless", "png", sink="local", key="frame").output
    assert stored[0]["uri"] == f"file://{local_sink}/frame.png" and stored[0]["size"] == len(png)
    assert not (local_sink / "frame.png").is_symlink() and (local_sink / "frame.png").read_bytes() == png
    assert (outside / "victim.png").read_bytes() == b"someone else's file"


def test_a_key_the_store_would_refuse_is_400_not_a_retried_503(sinks_app, s3_server):
    """An object name of 1,015 bytes (2-byte characters) passes S3's 1,024 but its temporary's does
    not: 400 naming `key` (checked with the request, before its decode), nothing stored."""
    url, _ = sinks_app
    key = "/".join(["é" * 100] * 5)
    answer = post(url, torch.randn(1, 4, 4, 6), sink="results", key=key)
    error = answer.json()["error"]
    assert (answer.status_code, error["field"]) == (400, "key") and "temporary" in error["message"], error
    assert s3_server.listing("served/é") == []


@pytest.mark.parametrize("sink", ["missing", "denied"])
def test_a_store_that_refuses_for_good_is_424_and_the_client_does_not_retry_it(sinks_app, sink, monkeypatch):
    """No such bucket, a policy that denies: `store_refused` (424, field `sink`, not 503), which
    the client raises at once; an outage (the gated store stopped) stays a retried 503 (above)."""
    from vae_service_client import StoreRefused

    url, _ = sinks_app
    slept = []
    monkeypatch.setattr("vae_service_client.retries.time.sleep", slept.append)
    with VaeClient(url, retries=3) as client, pytest.raises(StoreRefused) as refused:
        client.decode(torch.randn(1, 4, 4, 6), "lossless", "png", sink=sink, key="x")
    assert (refused.value.status, refused.value.type, refused.value.field) == (424, "store_refused", "sink")
    assert f"sink {sink!r} refused" in refused.value.message and slept == []


def test_a_store_that_never_answers_holds_only_its_own_sink(sinks_app, local_sink):
    """A store that accepts and never answers, one write at a time: while its write hangs, a second
    request to it is refused at once (503 + Retry-After, not queued behind the hung call) and a
    healthy sink writes as usual; the hung request answers 503 after the sink's write_timeout_s, and
    /health shows the sink's stuck call."""
    import concurrent.futures

    url, _ = sinks_app
    z = torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(13))

    def sink_writes() -> dict:
        return httpx.get(f"{url}/health", timeout=30).json()["sink_writes"]["hung"]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hung = pool.submit(post, url, z, sink="hung", key="first")
        deadline = time.monotonic() + 30
        while not sink_writes()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = post(url, z, sink="hung", key="second")
        assert (busy.status_code, busy.json()["error"]["field"]) == (503, "sink") and "Retry-After" in busy.headers
        assert "is busy" in busy.json()["error"]["message"] and not hung.done()
        healthy = post(url, z, sink="local", key="while-hung")
        assert healthy.status_code == 200 and (local_sink / "while-hung.png").is_file()
        answer = hung.result(timeout=60)
    error = answer.json()["error"]
    assert (answer.status_code, error["field"]) == (503, "sink") and "write_timeout_s" in error["message"]
    assert sink_writes() | {"written": 0} == {
        "capacity": 1, "in_flight": 0, "stuck": 1, "written": 0, "failed": 0, "refused": 1
    }  # fmt: skip


def _npy(z: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    np.save(buf, z.numpy(), allow_pickle=False)
    return buf.getvalue()


def test_batch_decode_reads_its_files_from_the_store_and_writes_the_services_answers(sinks_app, s3_server, kl_dir):
    url, _ = sinks_app
    gen = torch.Generator().manual_seed(7)
    latents = {"odd": torch.randn(1, 4, 5, 3, generator=gen), "pair": torch.randn(2, 4, 4, 6, generator=gen)}
    fs = s3_server.filesystem()
    for name, z in latents.items():
        with fs.open_output_stream(f"{BUCKET}/batch/in/{name}.npy") as f:
            f.write(_npy(z))
    config = {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1}
    summary = run_batch_decode(s3_server.uri("batch/in"), s3_server.uri("batch/out"), config, output="png")
    assert (summary.total, summary.counts["decoded"], summary.failures) == (2, 2, [])
    with VaeClient(url) as client:
        expected = {name: client.decode(z, "lossless", "png").output for name, z in latents.items()}
    assert s3_server.read("batch/out/odd.png") == expected["odd"][0]
    assert [s3_server.read(f"batch/out/pair-{i}.png") for i in range(2)] == expected["pair"]
    assert s3_server.listing("batch/out") == ["batch/out/odd.png", "batch/out/pair-0.png", "batch/out/pair-1.png"]


def test_batch_decode_of_parquet_in_the_store_resumes_after_the_store_stopped_mid_job(sinks_app, s3_server, kl_dir):
    """The store stops as the third input's file is moved to its name: the two before stay whole,
    the engine stops after three store failures in a row, and the rerun (the store back) writes the
    rest and removes the temporary the cut move left."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    url, _ = sinks_app
    gen = torch.Generator().manual_seed(11)
    names = list("abcdef")
    latents = [torch.randn(4, 3 + i % 2, 4, generator=gen) for i in range(len(names))]
    table = pa.table({"name": names, "latents": [z.tolist() for z in latents]})
    pq.write_table(table, f"{BUCKET}/pq/in/latents.parquet", filesystem=s3_server.filesystem())
    with VaeClient(url) as client:
        expected = {n: client.decode(z[None], "lossless", "png").output[0] for n, z in zip(names, latents, strict=True)}
    config = {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1}
    gate = Gate(s3_server.endpoint, close_on=rb"PUT /%s/pq/out/c\.png[ ?]" % BUCKET.encode())
    fragile = "?endpoint_override={}&scheme=http&retry_attempts=1&connect_timeout_s=1"
    source, target = (f"s3://{BUCKET}/pq/{part}" + fragile.format(gate.endpoint) for part in ("in", "out"))
    try:
        cut = run_batch_decode(source, target, config, output="png")
    finally:
        gate.close()
    assert (cut.total, cut.counts["decoded"], cut.counts["failed"], cut.counts["stopped"]) == (6, 2, 3, 1)
    assert [n for n, _ in cut.failures] == ["c", "d", "e"] and all(r.startswith("store: ") for _, r in cut.failures)
    assert "3 inputs in a row" in cut.stopped_by and "stopped:" in cut.report()
    written = s3_server.listing("pq/out")
    assert [p for p in written if not p.rsplit("/", 1)[1].startswith(".")] == ["pq/out/a.png", "pq/out/b.png"]
    assert [p.rsplit("/", 1)[1].split(".")[1] for p in written if p.rsplit("/", 1)[1].startswith(".")] == ["c"]
    assert [s3_server.read(f"pq/out/{n}.png") for n in "ab"] == [expected["a"], expected["b"]]

    again = run_batch_decode(s3_server.uri("pq/in"), s3_server.uri("pq/out"), config, output="png")
    assert (again.counts["skipped"], again.counts["decoded"], again.failures, again.stopped_by) == (2, 4, [], "")
    assert again.temporaries_removed == 1
    assert s3_server.listing("pq/out") == [f"pq/out/{n}.png" for n in names]
    assert {n: s3_server.read(f"pq/out/{n}.png") for n in names} == expected
