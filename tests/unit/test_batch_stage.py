"""The batch job's decode stage in-process (no Ray): outputs named after their inputs and equal to
diffusers' decode, every bad input a `failed` row with its reason while the others decode, finished
inputs skipped by their files, and nothing from a file ever unpickled."""

import io
import os
import pickle
import posixpath
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from tests.models import reference_decode, torch_threads
from tests.s3 import BUCKET, Gate
from vae_service.batch.job import BatchSummary, Progress
from vae_service.batch.outputs import OutputFolder, check_name
from vae_service.batch.stage import DecodeStage
from vae_service.engine.media.postprocess import to_uint8
from vae_service.storage.keys import temporary_name, temporary_of


def rows(*files: Path) -> dict:
    return {"name": np.array([f.stem for f in files]), "path": np.array([str(f) for f in files])}


def as_dict(out: dict) -> dict:
    columns = (out[k] for k in ("name", "status", "files", "error"))
    return {str(n): (str(s), int(f), str(e)) for n, s, f, e in zip(*columns, strict=True)}


@pytest.fixture
def stage(kl_dir, tmp_path):
    def make(output="png", quality="lossless"):
        return DecodeStage(
            {"model": str(kl_dir), "cpu_threads": 1}, str(tmp_path / "out"), output, quality, {"scaling_factor": None}
        )

    with torch_threads(torch.get_num_threads()):  # the stage binds its thread count; restore it after
        yield make


def test_files_decode_to_the_lossless_pixels_named_after_their_inputs(stage, kl_reference, tmp_path):
    gen = torch.Generator().manual_seed(0)
    one, two = torch.randn(1, 4, 5, 3, generator=gen), torch.randn(2, 4, 3, 4, generator=gen)
    np.save(tmp_path / "one.npy", one.numpy())
    save_file({"z": two.half()}, tmp_path / "two.safetensors")
    out = stage()(rows(tmp_path / "one.npy", tmp_path / "two.safetensors"))
    assert as_dict(out) == {"one": ("decoded", 1, ""), "two": ("decoded", 2, "")}
    with torch_threads(1):
        expected = {
            "one.png": to_uint8(reference_decode(kl_reference, one))[0],
            "two-0.png": to_uint8(reference_decode(kl_reference, two.half().float()))[0],
            "two-1.png": to_uint8(reference_decode(kl_reference, two.half().float()))[1],
        }
    assert sorted(os.listdir(tmp_path / "out")) == sorted(expected)
    for name, pixels in expected.items():
        np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "out" / name)), pixels.numpy())


def test_npy_output_holds_the_uint8_answer_of_each_input(stage, kl_reference, tmp_path):
    z = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    np.save(tmp_path / "pair.npy", z.numpy())
    assert as_dict(stage("npy")(rows(tmp_path / "pair.npy"))) == {"pair": ("decoded", 1, "")}
    with torch_threads(1):
        expected = to_uint8(reference_decode(kl_reference, z)).numpy()
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "pair.npy", allow_pickle=False), expected)


class _Trap:
    """Unpickling it would create a file: proof that nothing is unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_every_bad_input_fails_alone_with_its_reason(stage, tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.zeros((1, 4, 3, 3), np.float32))
    (tmp_path / "garbage.npy").write_bytes(b"not a numpy file")
    marker = tmp_path / "unpickled"
    np.save(tmp_path / "pickled.npy", np.array([_Trap(str(marker))], dtype=object), allow_pickle=True)
    np.save(tmp_path / "channels.npy", np.zeros((1, 3, 3, 3), np.float32))
    np.save(tmp_path / "ints.npy", np.zeros((1, 4, 3, 3), np.int64))
    save_file({"a": torch.zeros(1, 4, 2, 2), "b": torch.zeros(1, 4, 2, 2)}, tmp_path / "two_tensors.safetensors")
    names = ["garbage", "pickled", "good", "channels", "ints", "two_tensors"]
    files = [next(tmp_path.glob(f"{n}.*")) for n in names]
    result = as_dict(stage()(rows(*files)))
    assert [result[n][0] for n in names] == ["failed", "failed", "decoded", "failed", "failed", "failed"]
    assert result["garbage"][2] == "garbage.npy: not a .npy file (no NumPy array header)"
    assert result["pickled"][2] == "pickled.npy: holds Python objects (dtype object), not a numeric array of latents"
    assert not marker.exists()
    # NumPy's own words for these suggest loading the file "unsafely" (running what it carries): never passed on
    assert not any("allow_pickle" in r[2] or "unsafe" in r[2] for r in result.values())
    assert result["channels"][2].startswith("latents: model") and "takes [B, 4, H, W]" in result["channels"][2]
    assert result["ints"][2].startswith("latents.dtype: unknown dtype int64")
    assert "two_tensors.safetensors holds ['a', 'b']" in result["two_tensors"][2]
    assert os.listdir(tmp_path / "out") == ["good.png"]


def test_a_row_name_cannot_write_outside_the_output_folder(stage, tmp_path):
    batch = {"name": np.array(["../escape", "ok"]), "latents": np.zeros((2, 4, 3, 3), np.float32)}
    result = as_dict(stage()(batch))
    assert result["../escape"][0] == "failed" and "must be a plain file name" in result["../escape"][2]
    assert result["ok"] == ("decoded", 1, "")
    assert os.listdir(tmp_path / "out") == ["ok.png"] and not (tmp_path / "escape.png").exists()


def nested(a: np.ndarray) -> np.ndarray:
    """A latent as Ray Data hands over a Parquet list column: object arrays of float64 arrays."""
    if a.ndim == 1:
        return a.astype(np.float64)
    out = np.empty(len(a), dtype=object)
    for i, part in enumerate(a):
        out[i] = nested(part)
    return out


def test_list_column_rows_decode_like_tensor_rows_and_ragged_ones_fail(stage, tmp_path):
    z = np.random.default_rng(2).standard_normal((4, 3, 5)).astype(np.float32)
    ragged = nested(z)
    ragged[1][2] = ragged[1][2][:4]
    latents = np.empty(3, dtype=object)
    latents[:] = [nested(z), ragged, z]
    result = as_dict(stage()({"name": np.array(["lists", "ragged", "tensor"]), "latents": latents}))
    assert result["lists"] == result["tensor"] == ("decoded", 1, "")
    assert result["ragged"][0] == "failed" and "must be rectangular" in result["ragged"][2]
    assert (tmp_path / "out" / "lists.png").read_bytes() == (tmp_path / "out" / "tensor.png").read_bytes()


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "..", "x\x00y"])
def test_check_name_refuses_what_is_not_a_plain_file_name(name):
    with pytest.raises(ValueError, match="plain file name"):
        check_name(name)


def test_finished_inputs_are_skipped_and_unfinished_ones_decoded_whole(stage, tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((2, 4, 3, 3), np.float32))
    np.save(tmp_path / "b.npy", np.ones((1, 4, 3, 3), np.float32))
    decode = stage()
    assert [s for s, _, _ in as_dict(decode(rows(tmp_path / "a.npy", tmp_path / "b.npy"))).values()] == [
        "decoded",
        "decoded",
    ]
    out = tmp_path / "out"
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    # an interruption between an input's files, and a temporary left by a killed write
    (out / "a-1.png").unlink()
    (out / ".b.png.123.tmp").write_bytes(b"partial")
    result = as_dict(decode(rows(tmp_path / "a.npy", tmp_path / "b.npy")))
    assert result == {"a": ("decoded", 2, ""), "b": ("skipped", 1, "")}
    assert (out / "b.png").stat().st_mtime_ns == written["b.png"]
    assert (out / "a-0.png").stat().st_mtime_ns != written["a-0.png"] and (out / "a-1.png").is_file()


def test_a_store_that_fails_for_three_inputs_in_a_row_stops_the_engine_and_a_success_resets_the_count(
    kl_dir, tmp_path, s3_server
):
    for name in "abcdef":
        np.save(tmp_path / f"{name}.npy", np.full((1, 4, 3, 3), ord(name) / 100, np.float32))
    gate = Gate(s3_server.endpoint)
    target = f"s3://{BUCKET}/unit/stage-stops?endpoint_override={gate.endpoint}&scheme=http&retry_attempts=1"
    with torch_threads(torch.get_num_threads()):
        decode = DecodeStage({"model": str(kl_dir), "cpu_threads": 1}, target, "png", options={"scaling_factor": None})
    files = [tmp_path / f"{n}.npy" for n in "abcdef"]
    decode.store_failures = 2  # two failures before a success: the count starts again
    assert as_dict(decode(rows(files[0])))["a"][0] == "decoded" and decode.store_failures == 0
    gate.close()
    result = as_dict(decode(rows(*files[1:])))
    assert [result[n][0] for n in "bcdef"] == ["failed", "failed", "failed", "stopped", "stopped"]
    assert all(result[n][2].startswith(f"store: s3://{BUCKET}/unit/stage-stops") for n in "bcd")
    assert result["e"][2] == result["f"][2] and result["e"][2].startswith("the store failed for 3 inputs in a row")
    assert s3_server.listing("unit/stage-stops") == ["unit/stage-stops/a.png"]


def test_a_rerun_removes_the_temporaries_of_its_own_files_and_no_others(tmp_path):
    folder = OutputFolder(tmp_path, "png")
    left = [".a.png.0123456789abcdef.tmp", ".a-1.mp4.fedcba9876543210.tmp", ".b.npy.00000000000000aa.tmp"]
    kept = [".z.png.0123456789abcdef.tmp", ".a.png.123.tmp", "a.png", ".a.gif.0123456789abcdef.tmp"]
    for name in left + kept:
        (tmp_path / name).write_bytes(b"x")
    assert folder.discard_temporaries({"a.png", "a-1.png", "b.png"}) == 3
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert OutputFolder(tmp_path / "missing", "png").discard_temporaries({"a.png"}) == 0
    # what it recognises is what a write makes
    made = posixpath.basename(temporary_name(str(tmp_path / "c-2.webp")))
    assert temporary_of(made) == "c-2.webp" and temporary_of("c-2.webp") is None


def test_output_folder_writes_each_file_whole(tmp_path):
    folder = OutputFolder(tmp_path, "png")
    paths = folder.paths("x", 2)
    assert [p.name for p in paths] == ["x-0.png", "x-1.png"] and not folder.finished(paths)
    folder.write(paths, [b"a", b"b"])
    assert folder.finished(paths) and sorted(os.listdir(tmp_path)) == ["x-0.png", "x-1.png"]
    with pytest.raises(ValueError, match="1 outputs for 2 files"):
        folder.write(paths, [b"a"])
    with pytest.raises(ValueError, match="output 'gif'"):
        OutputFolder(tmp_path, "gif")


def test_a_stopped_jobs_summary_names_the_first_failures_and_why_it_stopped():
    summary = BatchSummary(total=30, temporaries_removed=2)
    for i in range(25):
        summary.add({"name": f"x{i}", "status": "failed", "items": 0, "error": f"store: s3://b/o/x{i}.png: refused"})
    for i in range(5):
        summary.add({"name": f"y{i}", "status": "stopped", "items": 0, "error": "the store failed for 3 inputs"})
    lines = summary.report().splitlines()
    assert lines[0].endswith("0 skipped (already done), 25 failed, 5 not tried")
    assert lines[1] == "  removed 2 temporaries an interrupted run left"
    assert lines[2:22] == [f"  failed x{i}: store: s3://b/o/x{i}.png: refused" for i in range(20)]
    assert lines[22:] == [
        "  ... and 5 more failed",
        "  stopped: the store failed for 3 inputs; what was written is whole, and a rerun resumes from there",
    ]
    assert summary.progress_line().startswith("[30/30 inputs] 0 decoded, 0 skipped, 25 failed, 5 not tried, ")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_and_summary_say_what_happened():
    """Rates count latent items decoded (an input holds one or more), not input files."""
    summary = BatchSummary(total=4)
    for row in (
        {"name": "a", "status": "decoded", "items": 2, "error": ""},
        {"name": "b", "status": "skipped", "items": 5, "error": ""},
        {"name": "c", "status": "failed", "items": 0, "error": "latents: bad"},
        {"name": "d", "status": "decoded", "items": 4, "error": ""},
    ):
        summary.add(row)
    summary.seconds = 1.5
    assert summary.progress_line() == "[4/4 inputs] 2 decoded, 1 skipped, 1 failed, 4.00 items/s"
    assert summary.report().splitlines() == [
        "4 of 4 inputs in 1.5 s: 2 decoded (6 items, 4.00 items/s), 1 skipped (already done), 1 failed",
        "  failed c: latents: bad",
    ]
    tty, log = _Tty(), io.StringIO()
    Progress(tty).show(summary)
    Progress(tty).show(summary, final=True)
    assert tty.getvalue() == "\r" + summary.progress_line() + "\r" + summary.progress_line() + "\n"
    shown = Progress(log, every_s=3600)
    shown.show(summary)  # the first line at once, then none until the interval or the end
    shown.show(summary)
    shown.show(summary, final=True)
    assert log.getvalue() == (summary.progress_line() + "\n") * 2


def test_pickle_of_trap_would_fire(tmp_path):
    """The trap above is armed: unpickling it does create the marker."""
    marker = tmp_path / "fired"
    pickle.loads(pickle.dumps(_Trap(str(marker))))
    assert marker.exists()


@pytest.mark.parametrize("output", [None, "webm"])
def test_video_models_write_an_mp4_of_every_decoded_frame_by_default(wan_dir, wan_vae, tmp_path, output):
    import av

    z = np.random.default_rng(5).standard_normal((1, wan_vae.config.z_dim, 2, 3, 4)).astype(np.float32)
    np.save(tmp_path / "clip.npy", z)
    with torch_threads(torch.get_num_threads()):
        stage = DecodeStage({"model": str(wan_dir), "cpu_threads": 1}, str(tmp_path / "out"), output)
        assert as_dict(stage(rows(tmp_path / "clip.npy"))) == {"clip": ("decoded", 1, "")}
    with av.open(str(tmp_path / "out" / f"clip.{output or 'mp4'}")) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (24, 32, 3)  # Wan: 4T-3 frames, 8x per side


def test_every_output_path_is_planned_up_front_and_a_clash_refused_naming_both_inputs(tmp_path):
    from vae_service.batch import BatchInputError, list_inputs

    np.save(tmp_path / "x.npy", np.zeros((2, 4, 2, 2), np.float32))  # writes x-0.png and x-1.png
    np.save(tmp_path / "x-1.npy", np.zeros((1, 4, 2, 2), np.float32))  # writes x-1.png
    with pytest.raises(BatchInputError, match=r"x-1\.npy and x\.npy would both write x-1\.png: rename one"):
        list_inputs(tmp_path)
    planned = list_inputs(tmp_path, "npy")  # one x.npy and one x-1.npy: no clash
    assert (planned.items, planned.total_items) == ({"x-1": 1, "x": 2}, 3)
    save_file({"z": torch.zeros(1, 4, 2, 2)}, tmp_path / "x.safetensors")
    with pytest.raises(BatchInputError, match=r"x\.npy and x\.safetensors are both input 'x'"):
        list_inputs(tmp_path, "npy")
    assert not (tmp_path / "out").exists()


def test_parquet_rows_of_one_name_are_refused_before_anything_is_decoded(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vae_service.batch import BatchInputError, list_inputs

    rows = [[0.0] * 4] * 3
    pq.write_table(pa.table({"name": ["a", "b", "a"], "latents": rows}), tmp_path / "rows.parquet")
    with pytest.raises(BatchInputError, match=r"rows 0 and 2 are both named 'a'"):
        list_inputs(tmp_path / "rows.parquet")
    pq.write_table(pa.table({"name": ["x-1", "x"], "latents": rows[:2]}), tmp_path / "fine.parquet")
    assert list_inputs(tmp_path / "fine.parquet").items == {"x-1": 1, "x": 1}
