"""A folder standing where an output file goes (a local sink, a batch-decode output folder): the
write is refused naming the output (a request's `key`: 400 invalid_request), the folder and what
it holds are left as they were, no temporary stays behind, and a store refusal (424
`store_refused`) keeps meaning a store that refuses for good."""

import numpy as np
import pytest
import torch

from tests.models import torch_threads
from tests.unit.test_sinks import settled
from vae_service.batch.stage import DecodeStage
from vae_service.config import Limits, Sink
from vae_service.engine import DecodeRequest, DecodeResult
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import InvalidInput, StoreRefused
from vae_service.engine.request.result import Timing
from vae_service.protocol.errors import wire_error
from vae_service.serving.outputs.sinks import Sinks
from vae_service.storage import InvalidKey, StoreUnavailable, open_location


def _folder_in_the_way(root, name: str):
    """A folder named like the output, holding a file of someone else's."""
    (root / name).mkdir(parents=True)
    (root / name / "theirs.txt").write_bytes(b"not yours")


def _left_as_it_was(root, name: str) -> None:
    assert (root / name).is_dir() and (root / name / "theirs.txt").read_bytes() == b"not yours"
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]  # no temporary left


@pytest.mark.parametrize("name", ["frame.png", "job-42/frame.png"])
def test_a_folder_where_a_file_goes_is_refused_naming_the_file_not_the_store(tmp_path, name):
    root = tmp_path / "sink"
    _folder_in_the_way(root, name)
    with pytest.raises(InvalidKey) as caught:
        open_location(str(root)).child(name).write_whole(b"\x89PNG data")
    assert not isinstance(caught.value, StoreUnavailable)
    assert repr(name) in str(caught.value) and "folder" in str(caught.value)
    _left_as_it_was(root, name)


async def test_a_sink_request_whose_output_name_is_a_folder_answers_400_naming_key(tmp_path):
    """The caller chose the name (`key`): 400 invalid_request naming `key` and the taken name, not
    424 store_refused (which says the deployment's bucket or credentials need fixing)."""
    root = tmp_path / "sink"
    _folder_in_the_way(root, "job-42/frame-1.png")
    sinks = Sinks({"disk": Sink(uri=str(root))}, retry_after_s=2.0)
    request = DecodeRequest(torch.zeros(2, 4, 2, 2), output="png", sink="disk", key="job-42/frame")
    encoded = DecodeResult([b"first", b"second"], "kl", "fp32", "lossless", None, Timing(0.0, 1.0, 2))
    with pytest.raises(InvalidInput) as caught:
        await sinks.store(encoded, request, RequestContext.admit(30.0, Limits()))
    assert not isinstance(caught.value, StoreRefused)
    answer = wire_error(caught.value)
    assert (answer.http_status, answer.type, answer.field) == (400, "invalid_request", "key")
    assert "'job-42/frame-1.png'" in answer.message and "folder" in answer.message
    assert "bucket" not in answer.message and "credential" not in answer.message
    settled(sinks)  # the answer came at the first failure: the other file's write may still be under way
    _left_as_it_was(root, "job-42/frame-1.png")
    assert (root / "job-42/frame-0.png").read_bytes() == b"first"  # the other file is whole under its name


def test_batch_decode_fails_the_input_whose_output_is_a_folder_and_goes_on(kl_dir, tmp_path):
    """Each such input is a `failed` row naming its output and the folder; it is no store failure,
    so three of them in a row do not stop the engine: the next input decodes."""
    out = tmp_path / "out"
    names = ["a", "b", "c", "d"]
    for name in names:
        np.save(tmp_path / f"{name}.npy", np.zeros((1, 4, 2, 2), np.float32))
    for name in names[:3]:
        _folder_in_the_way(out, f"{name}.png")
    with torch_threads(torch.get_num_threads()):  # the stage binds its thread count; restore it after
        stage = DecodeStage({"model": str(kl_dir), "cpu_threads": 1}, str(out), "png", "lossless", {})
        rows = stage({"name": np.array(names), "path": np.array([str(tmp_path / f"{n}.npy") for n in names])})
    results = {str(n): (str(s), str(e)) for n, s, e in zip(rows["name"], rows["status"], rows["error"], strict=True)}
    for name in names[:3]:
        status, error = results[name]
        assert status == "failed" and f"'{name}.png'" in error and "folder" in error, results
        assert not error.startswith("store:"), results
        _left_as_it_was(out, f"{name}.png")
    assert results["d"] == ("decoded", "") and (out / "d.png").is_file()
