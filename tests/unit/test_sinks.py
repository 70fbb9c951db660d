"""Object-storage sinks (vae_service/storage, serving/outputs/sinks.py): keys that cannot leave their
prefix, whole writes to a local folder and to a real S3-compatible store (moto's server, through
pyarrow's S3FileSystem), a write that fails mid-way or a store that stops mid-request leaving
nothing under the final name, and the typed errors a request gets."""

import asyncio
import hashlib
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from tests.ports import free_port
from tests.s3 import BUCKET, Gate
from vae_service.config import Limits, ServiceConfig, Sink
from vae_service.engine import DecodeRequest, DecodeResult
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeTimeout, InvalidInput, Unavailable
from vae_service.engine.request.result import Timing
from vae_service.serving.outputs.sinks import Sinks
from vae_service.storage import InvalidKey, StoreUnavailable, check_key, object_names, open_location
from vae_service.storage import locations as storage_locations


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/etc/passwd",
        "../up",
        "a/../../up",
        "a/./b",
        ".hidden",
        "a//b",
        "a/",
        "s3://other-bucket/x",
        "a\\..\\b",
        "a\x00b",
        "a\nb",
        "a\u202eb",  # a bidi override: a name that reads otherwise than it is
        "a?endpoint_override=evil:1",
        "a#b",
        "k" * 513,
        "s" * 201 + "/x",
    ],
)
def test_a_key_that_could_leave_its_prefix_is_refused(key):
    with pytest.raises(InvalidKey):
        check_key(key)


def test_object_names_are_batch_decodes_and_bounded_with_their_prefix():
    assert check_key("job-42/frame..v2 ünï") == "job-42/frame..v2 ünï"
    assert object_names("job-42/frame", "png", 1) == ["job-42/frame.png"]
    assert object_names("job-42/frame", "webm", 2) == ["job-42/frame-0.webm", "job-42/frame-1.webm"]
    with pytest.raises(InvalidKey, match="at most 1024"):
        object_names("k" * 100, "png", 1, prefix="p" * 1000)
    with pytest.raises(InvalidKey, match="non-empty string"):
        object_names(42, "png", 1)


@pytest.mark.parametrize(
    "uri, says",
    [
        ("s3://AKIA:s3cr3t-v@bucket/p", "credentials never go in a URI"),
        ("s3://bucket/p?secret_key=s3cr3t-v", "credentials never go in a URI"),
        ("relative/folder", "absolute path"),
        ("s3://bucket/../other", "'..' are not allowed"),
        ("hdfs://nn/x", "not one of"),
        ("s3://bucket/p?bogus=1", "unknown option 'bogus'"),
    ],
)
def test_a_sink_config_names_a_location_without_credentials(uri, says):
    from vae_service.cli import config_errors

    with pytest.raises(ValueError, match=says) as caught:
        Sink(uri=uri)
    assert "s3cr3t-v" not in str(caught.value)  # not in the message, nor as pydantic's input_value
    with pytest.raises(ValueError) as caught:
        ServiceConfig(sinks={"results": {"uri": uri}})
    assert "s3cr3t-v" not in str(caught.value) and "s3cr3t-v" not in config_errors(caught.value)  # the CLI's line


def test_an_endpoint_with_credentials_in_it_is_refused_without_repeating_them():
    with pytest.raises(ValueError, match="credentials never go in endpoint_override") as caught:
        Sink(uri="s3://bucket/p", endpoint_override="http://AKIA:secret@minio:9000")
    assert "secret" not in str(caught.value)
    with pytest.raises(ValueError, match="credentials never go in endpoint_override"):
        open_location("s3://bucket/p?endpoint_override=http://AKIA:secret@minio:9000")


def test_sink_names_are_plain_and_the_config_takes_several():
    config = ServiceConfig(sinks={"results": {"uri": "s3://b/p", "region": "eu-west-1"}, "disk": {"uri": "/srv/out"}})
    assert sorted(config.sinks) == ["disk", "results"] and config.sinks["results"].retry_attempts == 3
    with pytest.raises(ValueError, match="pattern"):
        ServiceConfig(sinks={"../x": {"uri": "/srv"}})
    with pytest.raises(ValueError, match="Extra inputs"):
        Sink(uri="s3://b/p", access_key="AKIA")  # credentials have no field


def test_a_local_folder_round_trip_writes_whole_files(tmp_path):
    root = open_location(f"file://{tmp_path}/sink")
    stored = root.child("job-42/frame.png").write_whole(b"\x89PNG data")
    assert stored.to_map() == {
        "uri": f"file://{tmp_path}/sink/job-42/frame.png",
        "size": 9,
        "sha256": hashlib.sha256(b"\x89PNG data").hexdigest(),
    }
    assert (tmp_path / "sink/job-42/frame.png").read_bytes() == b"\x89PNG data"
    assert [p.name for p in root.files(recursive=True)] == ["frame.png"]  # no temporary left


def _outside_and_sink(tmp_path):
    """An outside folder holding a file someone else owns, and a sink folder with `shared`, a link
    to the outside folder, planted inside it."""
    outside, sink = tmp_path / "outside", tmp_path / "sink"
    outside.mkdir()
    sink.mkdir()
    (outside / "victim.png").write_bytes(b"not yours")
    (sink / "shared").symlink_to(outside, target_is_directory=True)
    return outside, sink


@pytest.mark.parametrize("key", ["shared/victim.png", "shared/made/dirs/x.png", "deep/shared/x.png"])
def test_a_name_through_a_link_in_a_local_sink_is_refused_and_nothing_is_written_outside(tmp_path, key):
    outside, sink = _outside_and_sink(tmp_path)
    (sink / "deep").mkdir()
    (sink / "deep/shared").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidKey, match="symbolic link"):
        open_location(str(sink)).child(key).write_whole(b"attacker's bytes")
    assert sorted(p.name for p in outside.iterdir()) == ["victim.png"]
    assert (outside / "victim.png").read_bytes() == b"not yours"


def test_a_link_in_place_of_the_final_name_is_replaced_by_the_file_inside_the_sink(tmp_path):
    outside, sink = _outside_and_sink(tmp_path)
    (sink / "frame.png").symlink_to(outside / "victim.png")
    (sink / "file").write_bytes(b"a file, not a folder")
    stored = open_location(str(sink)).child("frame.png").write_whole(b"the answer")
    assert not (sink / "frame.png").is_symlink() and (sink / "frame.png").read_bytes() == b"the answer"
    assert stored.uri == f"file://{sink}/frame.png"
    assert (outside / "victim.png").read_bytes() == b"not yours"
    with pytest.raises(InvalidKey, match="not a folder"):
        open_location(str(sink)).child("file/x.png").write_whole(b"x")


def test_links_swapped_in_while_a_write_is_in_flight_change_nothing(tmp_path, monkeypatch):
    """Between two chunks of a write, its folder is moved away and replaced by a link to the outside,
    and a link is planted at its final name: the file lands in the folder the write held open (the
    moved one, inside the sink), nothing outside changes."""
    monkeypatch.setattr(storage_locations, "CHUNK_BYTES", 4)
    outside, sink = _outside_and_sink(tmp_path)
    (sink / "job").mkdir()
    swapped = []

    def swap_links_midway():
        if not swapped:
            (sink / "job").rename(sink / "job-moved")
            (sink / "job").symlink_to(outside, target_is_directory=True)
            (sink / "job-moved/x.png").symlink_to(outside / "victim.png")
            swapped.append(True)

    open_location(str(sink)).child("job/x.png").write_whole(b"0123456789ab", swap_links_midway)
    assert swapped and (sink / "job-moved/x.png").read_bytes() == b"0123456789ab"
    assert not (sink / "job-moved/x.png").is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["victim.png"]
    assert (outside / "victim.png").read_bytes() == b"not yours"
    assert sorted(p.name for p in (sink / "job-moved").iterdir()) == ["x.png"]  # no temporary left


def test_a_key_whose_temporary_the_store_would_refuse_is_refused_before_anything():
    """The bound counts what the store is asked to make: the prefix, the item's suffix and the
    temporary's decoration (22 bytes), in bytes (2-byte characters here)."""
    key = "/".join(["é" * 100] * 5)  # 504 characters, 1,004 bytes
    assert len(f"served/{key}.png".encode()) == 1015  # within 1,024: accepted before its temporary counted
    with pytest.raises(InvalidKey, match="temporary"):
        object_names(key, "png", 1, prefix="served")
    fits = "/".join(["é" * 100] * 4 + ["é" * 90])
    assert len(storage_locations.temporary_name(f"served/{fits}.png").encode()) <= 1024
    assert object_names(fits, "png", 1, prefix="served") == [f"{fits}.png"]


def test_a_segments_bound_is_in_bytes_not_characters():
    with pytest.raises(InvalidKey, match="201 bytes"):
        check_key("é" * 100 + "x")  # 101 characters, 201 bytes
    assert check_key("é" * 100) == "é" * 100


class _FailingStream:
    """An output stream whose store goes away after `limit` bytes."""

    def __init__(self, inner, limit: int):
        self.inner, self.limit, self.written = inner, limit, 0

    def write(self, data) -> int:
        data = bytes(data)
        if self.written + len(data) > self.limit:
            self.inner.write(data[: self.limit - self.written])
            raise OSError("connection reset by the store")
        self.written += len(data)
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed


class _FaultyFileSystem(pafs.FileSystemHandler):
    """The local file system, but output streams fail after `limit` bytes."""

    def __init__(self, limit: int):
        self.inner, self.limit = pafs.LocalFileSystem(), limit

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def get_type_name(self):
        return "faulty"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.inner.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self.inner.delete_file(path)

    def move(self, src, dest):
        self.inner.move(src, dest)

    def copy_file(self, src, dest):
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.inner.open_input_stream(path)

    def open_input_file(self, path):
        return self.inner.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_FailingStream(self.inner.open_output_stream(path), self.limit), mode="w")

    def open_append_stream(self, path, metadata):
        raise NotImplementedError


def test_a_write_that_fails_midway_leaves_nothing_under_its_name(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_locations, "CHUNK_BYTES", 4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out/x.png").write_bytes(b"the previous, whole file")
    faulty = open_location(str(tmp_path / "out"))
    faulty = storage_locations.Location(pafs.PyFileSystem(_FaultyFileSystem(limit=6)), faulty.path, faulty.uri)
    with pytest.raises(StoreUnavailable, match="connection reset"):
        faulty.child("x.png").write_whole(b"0123456789ab")  # 3 chunks: the store goes away in the second
    with pytest.raises(StoreUnavailable):
        faulty.child("y.png").write_whole(b"0123456789ab")
    # a write stopped by its request (past its deadline) between chunks: the same
    calls = []

    def deadline_passes_midway():
        calls.append(1)
        if len(calls) == 2:
            raise DecodeTimeout("body", "past the deadline")

    with pytest.raises(DecodeTimeout):
        open_location(str(tmp_path / "out")).child("z.png").write_whole(b"0123456789ab", deadline_passes_midway)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.png"]  # no temporaries either
    assert (tmp_path / "out/x.png").read_bytes() == b"the previous, whole file"


def test_an_s3_round_trip_through_pyarrow_against_moto(s3_server, monkeypatch):
    data = bytes(range(256)) * 1000
    root = open_location(s3_server.uri("unit/round"))
    stored = root.child("job-42/frame-1.png").write_whole(data)
    assert stored.to_map() == {
        "uri": f"s3://{BUCKET}/unit/round/job-42/frame-1.png",  # no endpoint, no query, no credentials
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert s3_server.read("unit/round/job-42/frame-1.png") == data
    assert s3_server.listing("unit/round") == ["unit/round/job-42/frame-1.png"]  # the temporary was moved
    assert root.all_exist(["job-42/frame-1.png"]) and not root.all_exist(["job-42/frame-1.png", "other.png"])
    # the endpoint from the environment, as pyarrow's FileSystem.from_uri reads it
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_server.endpoint}")
    assert open_location(f"s3://{BUCKET}/unit/round").child("job-42/frame-1.png").read_bytes() == data


def test_a_store_stopped_mid_request_raises_a_typed_error_and_leaves_nothing_under_the_name(s3_server):
    gate = Gate(s3_server.endpoint)
    location = open_location(
        f"s3://{BUCKET}/unit/stopped", endpoint_override=gate.endpoint, scheme="http", retry_attempts=1
    )
    checks = []

    def store_stops_before_the_move():
        checks.append(1)
        if len(checks) == 2:  # the temporary is written; the store goes away before it is moved
            gate.close()

    with pytest.raises(StoreUnavailable, match=f"s3://{BUCKET}/unit/stopped/x.png"):
        location.child("x.png").write_whole(b"whole or nothing", store_stops_before_the_move)
    assert len(checks) == 2
    assert s3_server.read("unit/stopped/x.png") is None
    # what the store still holds is a hidden temporary, never the final name
    assert all(p.rsplit("/", 1)[-1].startswith(".x.png.") for p in s3_server.listing("unit/stopped"))


# ---- the serving layer: a request's sink and key, its files, its typed errors ---------------------
def _request(sink="disk", key="job-42/frame", output="png", items=2, **fields) -> DecodeRequest:
    return DecodeRequest(torch.zeros(items, 4, 2, 2), output=output, sink=sink, key=key, **fields)


def _encoded(files: list[bytes]) -> DecodeResult:
    return DecodeResult(files, "kl", "fp32", "lossless", None, Timing(0.0, 1.0, len(files)))


@pytest.fixture
def sinks(tmp_path):
    down = f"127.0.0.1:{free_port()}"  # nothing listens there: a store that is down
    configured = {
        "disk": Sink(uri=str(tmp_path / "sink")),
        "down": Sink(uri=f"s3://{BUCKET}/x", endpoint_override=down, scheme="http", retry_attempts=1),
    }
    sinks = Sinks(configured, retry_after_s=2.0)
    yield sinks
    settled(sinks)


def settled(sinks: Sinks, timeout_s: float = 30.0) -> None:
    """Every write of every sink ended (its thread returned)."""
    deadline = time.monotonic() + timeout_s
    while any(w["in_flight"] or w["stuck"] for w in sinks.describe().values()):
        assert time.monotonic() < deadline, sinks.describe()
        time.sleep(0.01)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"key": None}, "key"),
        ({"sink": None}, "sink"),
        ({"output": "uint8"}, "output"),
        ({"output": "float"}, "output"),
        ({"stream": True}, "stream"),
    ],
)
def test_a_request_with_a_sink_needs_a_key_and_encoded_whole_files(fields, field):
    with pytest.raises(InvalidInput) as caught:
        _request(**fields)
    assert caught.value.field == field


def test_an_unknown_sink_or_an_escaping_key_is_refused_naming_it(sinks):
    with pytest.raises(InvalidInput, match=r"unknown sink 'results' \(this deployment's sinks: \['disk', 'down'\]\)"):
        sinks.check(_request(sink="results"))
    with pytest.raises(InvalidInput) as caught:
        sinks.check(_request(key="../../etc/x"))
    assert caught.value.field == "key"
    assert sinks.check(_request()) is not None and Sinks({}, 1.0).names == []


async def test_a_request_s_files_go_to_its_sink_and_the_answer_says_where(sinks, tmp_path):
    request = _request()
    context = RequestContext.admit(30.0, Limits())
    result = await sinks.store(_encoded([b"first", b"second"]), request, context)
    assert result.output == [
        {
            "uri": f"file://{tmp_path}/sink/job-42/frame-{i}.png",
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        for i, data in enumerate([b"first", b"second"])
    ]
    assert (tmp_path / "sink/job-42/frame-1.png").read_bytes() == b"second"


async def test_a_store_that_is_down_answers_503_naming_the_sink(sinks):
    with pytest.raises(Unavailable) as caught:
        await sinks.store(_encoded([b"x"]), _request(sink="down", items=1), RequestContext.admit(30.0, Limits()))
    assert (caught.value.field, caught.value.retry_after_s) == ("sink", 2.0)
    assert "sink 'down' could not be written (error id" in caught.value.message
    assert "127.0.0.1" not in caught.value.message  # the store's address stays in the log


async def test_a_request_past_its_deadline_stores_nothing(sinks, tmp_path):
    late = RequestContext(time.monotonic() - 1.0, Limits())
    with pytest.raises(DecodeTimeout) as caught:
        await sinks.store(_encoded([b"a", b"b"]), _request(), late)
    assert caught.value.field == "sink"
    settled(sinks)  # the writes that began stop at their first check
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no file, and no temporary (.name.tmp) left


class _HangingFileSystem(_FaultyFileSystem):
    """A store that accepts a write and never answers it, until `answers` is set."""

    def __init__(self):
        super().__init__(limit=2**30)
        self.answers, self.calls = threading.Event(), 0

    def open_output_stream(self, path, metadata):
        self.calls += 1
        self.answers.wait()
        return super().open_output_stream(path, metadata)


class _LoopClock:
    """The running event loop's clock (its timers: a sink's write_timeout_s) as real time plus what
    the test moved it on by: a timer set an hour ahead fires when the test says, not before."""

    def __init__(self, monkeypatch):
        loop, self.moved = asyncio.get_running_loop(), 0.0
        real = loop.time
        monkeypatch.setattr(loop, "time", lambda: real() + self.moved)

    async def advance(self, seconds: float) -> None:
        self.moved += seconds
        for _ in range(3):  # the loop's next rounds run the timers now due
            await asyncio.sleep(0)


async def test_a_hung_store_holds_only_its_own_sinks_writes(tmp_path, monkeypatch):
    """Two writes at once on the hung sink: a third request is refused at once (503 + Retry-After
    naming the sink, not queued), a healthy sink meanwhile writes as usual, while the hung sink's
    slots are all still held; the hung requests answer 503 once write_timeout_s passed (on the loop's
    clock, moved by the test), their calls left stuck (and counted) while the store says nothing;
    once it answers, the stuck calls end and the sink writes again."""
    clock = _LoopClock(monkeypatch)
    hanging = _HangingFileSystem()
    config = {
        "hung": Sink(uri=str(tmp_path / "hung"), max_concurrent_writes=2, write_timeout_s=3600.0),
        "disk": Sink(uri=str(tmp_path / "disk")),
    }
    sinks = Sinks(config, retry_after_s=2.0)
    root = open_location(str(tmp_path / "hung"))
    sinks._locations["hung"] = storage_locations.Location(pafs.PyFileSystem(hanging), root.path, root.uri)
    admitted = lambda: RequestContext.admit(30.0, Limits())  # noqa: E731
    hung = [  # their deadline past their sink's write_timeout_s: the timeout that ends them is the sink's
        asyncio.ensure_future(
            sinks.store(_encoded([b"a"]), _request("hung", f"k{i}", items=1), RequestContext.admit(7200.0, Limits()))
        )
        for i in (0, 1)
    ]
    while hanging.calls < 2:
        await asyncio.sleep(0.01)
    with pytest.raises(Unavailable) as busy:
        await sinks.store(_encoded([b"b"]), _request("hung", "k2", items=1), admitted())
    assert (busy.value.field, busy.value.retry_after_s) == ("sink", 2.0) and "sink 'hung' is busy" in busy.value.message
    # the healthy sink's own write_timeout_s (20 s) would fail this write had it waited on the hung
    # sink's slots or threads: those stay held until the test moves the clock an hour on
    healthy = await sinks.store(_encoded([b"c", b"d"]), _request("disk", "ok"), admitted())
    assert len(healthy.output) == 2 and not any(f.done() for f in hung)
    assert sinks.describe()["hung"]["in_flight"] == 2 and sinks.describe()["disk"]["written"] == 2
    await clock.advance(1800.0)  # half the sink's write_timeout_s: still waiting
    assert not any(f.done() for f in hung) and sinks.describe()["hung"]["in_flight"] == 2
    await clock.advance(1800.0)
    for future in hung:
        with pytest.raises(Unavailable, match=r"did not answer within write_timeout_s \(3600 s\)"):
            await future
    assert sinks.describe()["hung"] | {"written": 0} == {
        "capacity": 2, "in_flight": 0, "stuck": 2, "written": 0, "failed": 0, "refused": 1
    }  # fmt: skip
    with pytest.raises(Unavailable, match="busy"):  # as many calls stuck as the sink's capacity: refused
        await sinks.store(_encoded([b"e"]), _request("hung", "k3", items=1), admitted())
    hanging.answers.set()
    settled(sinks)
    again = await sinks.store(_encoded([b"f"]), _request("hung", "k4", items=1), admitted())
    assert (tmp_path / "hung/k4.png").read_bytes() == b"f" and again.output[0]["size"] == 1
    assert not (tmp_path / "hung/k0.png").exists()  # the abandoned writes stopped before their move


def test_handles_take_sink_and_key_as_keyword_arguments():
    from vae_service.protocol.requests import request_from_call

    request = request_from_call(torch.zeros(1, 4, 2, 2), output="webp", sink="disk", key="a/b")
    assert (request.sink, request.key, request.output) == ("disk", "a/b", "webp")


def test_batch_inputs_are_listed_from_the_store_reading_headers_only(s3_server):
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vae_service.batch import BatchInputError, list_inputs

    fs = s3_server.filesystem()
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 4, 2, 2), np.float32))
    with fs.open_output_stream(f"{BUCKET}/unit/inputs/npy/x.npy") as f:
        f.write(buf.getvalue())
    inputs = list_inputs(s3_server.uri("unit/inputs/npy"))
    assert (inputs.items, [p.spec for p in inputs.files]) == ({"x": 3}, [s3_server.uri("unit/inputs/npy/x.npy")])
    pq.write_table(
        pa.table({"name": ["a", "b"], "latents": [[0.0] * 4] * 2}), f"{BUCKET}/unit/inputs/pq/t.parquet", filesystem=fs
    )
    assert list_inputs(s3_server.uri("unit/inputs/pq")).items == {"a": 1, "b": 1}
    with pytest.raises(BatchInputError, match="not a folder of latents files"):
        list_inputs(s3_server.uri("unit/inputs/none"))
    with pytest.raises(BatchInputError, match="credentials never go in a URI"):
        list_inputs(f"s3://key:secret@{BUCKET}/unit")


@pytest.mark.parametrize("field", ["sink", "key"])
def test_a_grpc_request_naming_a_sink_is_refused_by_the_client_naming_the_field(field):
    """The gRPC DecodeRequest has no sink fields: before, an AttributeError from protobuf."""
    from vae_service_client import InvalidRequest
    from vae_service_client.messages import request_proto

    with pytest.raises(InvalidRequest) as err:
        request_proto(torch.zeros(1, 4, 8, 8), output="png", **{field: "results"})
    assert err.value.field == field and "HTTP and Serve handles" in err.value.message


@pytest.mark.parametrize(
    "text, for_good",
    [
        ("When initiating multiple part upload for key 'a.png' in bucket 'b': AWS Error NO_SUCH_BUCKET during "
         "CreateMultipartUpload operation: The specified bucket does not exist", True),
        ("When uploading part for key 'x' in bucket 'b': AWS Error ACCESS_DENIED during UploadPart operation", True),
        ("AWS Error UNKNOWN (HTTP status 403) during PutObject operation: Forbidden", True),
        ("AWS Error UNKNOWN (HTTP status 400) during CreateBucket operation: InvalidBucketName", True),
        ("google::cloud::Status(PERMISSION_DENIED: caller does not have storage.objects.create access)", True),
        ("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7, Couldn't connect to server", False),
        ("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate", False),
        ("AWS Error UNKNOWN (HTTP status 503) during PutObject operation: Service Unavailable", False),
        ("AWS Error UNKNOWN (HTTP status 4030) during PutObject operation", False),
    ],
)  # fmt: skip
def test_a_stores_refusal_for_good_is_told_from_an_outage(text, for_good):
    assert storage_locations.refused_for_good(OSError(text)) is for_good


def test_a_local_permission_refusal_is_for_good_and_a_full_disk_is_not():
    import errno

    assert storage_locations.refused_for_good(PermissionError(errno.EACCES, "Permission denied"))
    assert storage_locations.refused_for_good(OSError(errno.EROFS, "Read-only file system"))
    assert not storage_locations.refused_for_good(OSError(errno.ENOSPC, "No space left on device"))
