"""Offline decode on Ray Data against the running service: the same files and pixels as the service
answers for the same latents (folder and Parquet inputs, both tiers, images and video), a rerun
after an interrupted run that decodes only the rest, and the CLI's progress and summary."""

import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from safetensors.torch import save_file

from tests.ports import free_port
from vae_service.batch import run_batch_decode
from vae_service.cli import main as cli
from vae_service_client import VaeClient

pytestmark = pytest.mark.integration


def kl_config(kl_dir) -> dict:
    return {"model": str(kl_dir), "model_name": "kl", "cpu_threads": 1}  # as the kl_url service


# Runs here use one decoding actor (the default) where the claim is about outputs, not the pool:
# every actor is a process that imports torch and loads the model (~7 s here). The CLI test runs
# two (`--concurrency 2`), writing into one output folder side by side.


@pytest.fixture
def kl_inputs(tmp_path):
    """Odd sizes, two items in one file, half precision in a safetensors file."""
    gen = torch.Generator().manual_seed(7)
    folder = tmp_path / "in"
    folder.mkdir()
    latents = {
        "odd": torch.randn(1, 4, 5, 3, generator=gen),
        "pair": torch.randn(2, 4, 4, 6, generator=gen),
        "half": torch.randn(1, 4, 3, 7, generator=gen).half(),
    }
    np.save(folder / "odd.npy", latents["odd"].numpy())
    np.save(folder / "pair.npy", latents["pair"].numpy())
    save_file({"latents": latents["half"]}, folder / "half.safetensors")
    return folder, latents


@pytest.mark.parametrize("quality, output", [("lossless", "png"), ("high", "npy")])
def test_folder_outputs_are_the_services_answers(ray_cluster, kl_url, kl_dir, kl_inputs, tmp_path, quality, output):
    folder, latents = kl_inputs
    out = tmp_path / "out"
    summary = run_batch_decode(folder, out, kl_config(kl_dir), quality=quality, output=output)
    assert (summary.total, summary.counts["decoded"], summary.failures) == (3, 3, [])
    with VaeClient(kl_url) as client:
        for name, z in latents.items():
            if output == "npy":  # the uint8 answer, all items in one file
                pixels = np.load(out / f"{name}.npy", allow_pickle=False)
                np.testing.assert_array_equal(pixels, client.decode(z, quality, "uint8").output)
                continue
            png = client.decode(z, quality, "png").output
            files = [f"{name}.png"] if len(png) == 1 else [f"{name}-{i}.png" for i in range(len(png))]
            assert [(out / f).read_bytes() for f in files] == png


def test_parquet_rows_of_video_latents_are_the_services_answers(ray_cluster, wan_url, wan_dir, wan_vae, tmp_path):
    gen = torch.Generator().manual_seed(3)
    channels = wan_vae.config.z_dim
    rows = {f"clip{i}": torch.randn(channels, t, 3, 5, generator=gen) for i, t in enumerate((1, 2, 3))}
    # a Ray tensor column (as Ray Data writes it) and a plain list column (as pandas or pyarrow would)
    tensors = tmp_path / "tensors"
    ray.data.from_items([{"name": n, "latents": z.numpy()} for n, z in rows.items()]).write_parquet(str(tensors))
    lists = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"name": list(rows), "latents": [z.tolist() for z in rows.values()]}), lists)
    config = {"model": str(wan_dir), "model_name": "wan", "cpu_threads": 1}
    with VaeClient(wan_url) as client:
        expected = {n: client.decode(z[None], "lossless", "uint8").output for n, z in rows.items()}
    for source in (tensors, lists):
        out = tmp_path / f"out-{source.stem}"
        summary = run_batch_decode(source, out, config, output="npy")
        assert (summary.counts["decoded"], summary.failures) == (3, [])
        for name, pixels in expected.items():
            np.testing.assert_array_equal(np.load(out / f"{name}.npy", allow_pickle=False), pixels)


def test_a_rerun_after_an_interrupted_run_decodes_only_the_rest(ray_cluster, kl_dir, tmp_path):
    """An interrupted run leaves some outputs whole, one a hidden temporary, the rest absent (made
    so here: stopping a Ray Data job at a chosen input is a race). The rerun decodes exactly the
    inputs without their output, and leaves finished ones untouched."""
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    for i in range(8):
        np.save(inputs / f"z{i}.npy", np.random.default_rng(i).standard_normal((1, 4, 4, 4)).astype(np.float32))
    first = run_batch_decode(inputs, out, kl_config(kl_dir))
    assert first.counts["decoded"] == 8
    whole = {i: (out / f"z{i}.png").read_bytes() for i in range(8)}
    for i in (5, 6, 7):  # cut short: z5 died while its file was written, z6 and z7 never started
        (out / f"z{i}.png").unlink()
    (out / f".z5.png.{os.getpid()}.tmp").write_bytes(whole[5][:10])
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}

    summary = run_batch_decode(inputs, out, kl_config(kl_dir))
    assert (summary.counts["skipped"], summary.counts["decoded"], summary.failures) == (5, 3, [])
    assert sorted(p.name for p in out.glob("*.png")) == [f"z{i}.png" for i in range(8)]
    assert all(os.stat(out / name).st_mtime_ns == mtime for name, mtime in before.items())
    assert all((out / f"z{i}.png").read_bytes() == whole[i] for i in range(8))


def test_cli_shows_progress_and_a_summary_and_reports_bad_inputs(ray_cluster, kl_dir, tmp_path, capfd):
    """Progress and rates in latent items; a damaged file's reason in a latents file's terms; no
    ERROR line of Ray's on a run whose only failure is an input's (before: one about the engines'
    constructor arguments on every run)."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(63):
        np.save(inputs / f"z{i:02d}.npy", rng.standard_normal((1, 4, 2, 2)).astype(np.float32))
    np.save(inputs / "pair.npy", rng.standard_normal((2, 4, 2, 2)).astype(np.float32))  # two items, one input
    (inputs / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    argv = ["batch-decode", str(inputs), str(tmp_path / "out"), "--model", str(kl_dir), "--concurrency", "2"]
    with pytest.raises(SystemExit) as exited:
        cli(argv)
    assert exited.value.code == 1  # done, with a failure to report
    printed = capfd.readouterr()
    assert "65 inputs (66 latent items)" in printed.out
    assert "[65/65 inputs] 64 decoded, 0 skipped, 1 failed" in printed.err and "items/s" in printed.err
    assert "65 of 65 inputs in" in printed.out
    assert "64 decoded (65 items, " in printed.out and "0 skipped (already done), 1 failed" in printed.out
    assert "failed broken: broken.safetensors: not a .safetensors file (its header is not valid)" in printed.out
    assert len(list((tmp_path / "out").glob("*.png"))) == 65
    assert not [line for line in (printed.out + printed.err).splitlines() if re.match(r"\[.* E \d+ \d+\]", line)]
    assert "ERROR" not in printed.out + printed.err

    (inputs / "broken.safetensors").unlink()
    cli(argv)  # everything is done already: no failure, exit status 0
    again = capfd.readouterr().out
    assert "64 of 64 inputs in" in again and "0 decoded (0 items, 0.00 items/s), 64 skipped (already done)" in again

    # an output store that does not answer: one line naming it, before any input is decoded
    dead = f"s3://bucket/out?endpoint_override=127.0.0.1:{free_port()}&scheme=http&retry_attempts=1"
    with pytest.raises(SystemExit) as exited:
        cli(["batch-decode", str(inputs), dead, "--model", str(kl_dir)])
    err = capfd.readouterr().err.strip().splitlines()
    assert exited.value.code == 1 and err[-1].startswith("vae-service: the output's store: s3://bucket/out: ")


def test_cli_refuses_inputs_that_would_write_one_file_before_anything_is_decoded(kl_dir, tmp_path, capsys):
    """Before: x.npy of two items and x-1.npy both wrote x-1.png (the check compared stems only),
    and Parquet names were not checked at all."""
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    np.save(inputs / "x.npy", np.zeros((2, 4, 2, 2), np.float32))
    np.save(inputs / "x-1.npy", np.zeros((1, 4, 2, 2), np.float32))
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"name": ["a", "b", "a"], "latents": [[0.0] * 16] * 3}), rows)
    for source, text in (
        (inputs, "x-1.npy and x.npy would both write x-1.png: rename one"),
        (rows, "rows 0 and 2 are both named 'a'"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli(["batch-decode", str(source), str(out), "--model", str(kl_dir)])
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and text in err[0]
    assert not out.exists()
