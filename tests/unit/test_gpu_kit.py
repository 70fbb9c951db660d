"""The GPU check kit without a GPU: bench/gpu_check.sh --dry-run passes (the wheelhouse resolves
for the GPU's Python, the steps import and collect under what the GPU machine has, every bench
step's flags parse); a flag no bench accepts, or a preset that does not exist, fails the dry run's
flag check; the budget skips a step that would not fit and a step's timeout is recorded as such.
Without .whl the dry run asks PyPI for the wheels' metadata (CI has network)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "bench" / "gpu_kit"


def kit_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPU_CHECK_ONLY", "GPU_CHECK_STEPS")}
    env.update(PYTHONPATH=f"{ROOT}:{ROOT / 'clients'}", DRY_PYTHON=sys.executable, PYTHON=sys.executable, **extra)
    return env


def test_the_dry_run_passes_and_writes_its_summary(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        env=kit_env(OUT=str(tmp_path / "out")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    steps = [line.split()[0] for line in (KIT / "steps.txt").read_text().splitlines() if line[:1].isalpha()]
    assert [s["name"] for s in summary["steps"]] == ["wheels", *steps]
    assert summary["ok"] and summary["mode"] == "dry"
    assert all(s["status"] == "passed" for s in summary["steps"]), summary["steps"]
    tests = next(s for s in summary["steps"] if s["name"] == "tests")
    assert "tests/gpu/test_cuda_kit_checks.py" in tests["tail"]  # collected, under the GPU machine's packages
    assert summary["env"]["packages"]["diffusers"]
    # a dry run checks each step without running it: a bench's flags parsed, the tests collected
    checked = {s["name"]: s for s in summary["steps"][1:]}
    assert all(s["note"] == "dry run" for s in checked.values()), summary["steps"]
    assert "pytest --collect-only: exit 0" in tests["tail"]
    assert "requirements of the wheels: met" in checked["env"]["tail"]
    benches = {n: s["tail"] for n, s in checked.items() if n not in ("env", "tests")}
    assert benches and all(": flags parsed: {" in tail for tail in benches.values()), benches
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "== dry fastpath: passed" in log and sorted(os.listdir(tmp_path / "out")) == [
        "gpu_check.log",
        "summary.json",
    ]


def tampered(steps: str) -> str:
    """Each step as it is, then a copy named `<name>_bad` of fastpath and video with a renamed flag
    and of replay with a preset that does not exist."""
    bad = []
    for line in steps.splitlines():
        name = line.split(" ", 1)[0]
        if name == "fastpath":
            bad.append(line.replace("fastpath ", "fastpath_bad ", 1).replace("--throughput ", "--throughputs "))
        elif name == "video":
            bad.append(line.replace("video ", "video_bad ", 1).replace("--tiled-fraction ", "--tile-fraction "))
        elif name == "replay":
            bad.append(line.replace("replay ", "replay_bad ", 1).replace("sd:2048", "sdxx:2048"))
    return steps + "\n".join(bad) + "\n"


def test_a_flag_no_bench_accepts_fails_the_flag_check(tmp_path):
    steps = tampered((KIT / "steps.txt").read_text())
    assert steps.count("--throughputs ") == 1 and steps.count("--tile-fraction ") == 1 and "sdxx:2048" in steps
    (tmp_path / "steps.txt").write_text(steps)
    records = tmp_path / "records.jsonl"
    only = "fastpath,video,replay,fastpath_bad,video_bad,replay_bad"
    command = [sys.executable, str(KIT / "kit.py"), "dry", "--records", str(records)]
    done = subprocess.run(
        [*command, "--steps", str(tmp_path / "steps.txt"), "--only", only],
        env=kit_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stdout[-6000:] + done.stderr[-3000:]
    by_name = {r["name"]: r for r in map(json.loads, records.read_text().splitlines())}
    assert {n: r["status"] for n, r in by_name.items()} == {
        "fastpath": "passed",
        "video": "passed",
        "replay": "passed",
        "fastpath_bad": "failed",
        "video_bad": "failed",
        "replay_bad": "failed",
    }
    assert re.search(r"unrecognized arguments: --throughputs", by_name["fastpath_bad"]["tail"])
    assert re.search(r"unrecognized arguments: --tile-fraction", by_name["video_bad"]["tail"])
    assert "no preset 'sdxx'" in by_name["replay_bad"]["tail"]


@pytest.fixture
def kit_copy(tmp_path) -> Path:
    """gpu_check.sh and the kit in a tree of their own (no .whl: nothing to install)."""
    root = tmp_path / "tree"
    shutil.copytree(KIT, root / "bench" / "gpu_kit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "bench" / "gpu_check.sh", root / "bench" / "gpu_check.sh")
    return root


def test_the_budget_skips_what_would_not_fit_and_a_timeout_is_recorded(kit_copy, tmp_path):
    (kit_copy / "steps.txt").write_text(
        "# name min max command\n"
        "quick  1  20  echo quick output\n"
        "slow   1  2   echo started; sleep 600\n"
        "fails  1  20  echo broken >&2; exit 7\n"
        "big    50 60  echo never\n"
    )
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(kit_copy / "bench" / "gpu_check.sh")],
        env=kit_env(OUT=str(out), GPU_CHECK_STEPS=str(kit_copy / "steps.txt"), GPU_CHECK_BUDGET_S="40"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == ["install", "quick", "slow", "fails", "big"]
    assert steps["install"]["status"] == "skipped"  # no .whl in this tree
    assert steps["quick"]["status"] == "passed" and "quick output" in steps["quick"]["tail"]
    # cut at its own timeout (2 s, not what was left of the budget): its command (10 minutes) was not
    # waited for, or this run's own timeout had fired
    assert steps["slow"]["status"] == "timeout" and steps["slow"]["rc"] == 124 and "started" in steps["slow"]["tail"]
    assert "== slow (timeout 2s," in (out / "gpu_check.log").read_text()
    assert steps["fails"]["status"] == "failed" and steps["fails"]["rc"] == 7 and "broken" in steps["fails"]["tail"]
    assert steps["big"]["status"] == "skipped" and "budget" in steps["big"]["note"]
    assert not summary["ok"] and summary["mode"] == "gpu" and summary["budget_s"] == 40
    log = (out / "gpu_check.log").read_text()
    assert "quick output" in log and "broken" in log and "== big: skipped" in log
