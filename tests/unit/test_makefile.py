"""`make serve` as a fresh machine runs it (a dry run into a venv that does not exist): what
serving needs and not the test tools, pip's progress shown, torch's build and the venv's size
said at the end, and gRPC off unless GRPC_PORT asks (Serve's gRPC proxy listens on every interface)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(*args: str, venv: Path) -> list[str]:
    """The commands `make ARGS` would run, as a top-level make (CI runs these tests under `make test`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *args, f"VENV={venv}"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return done.stdout.splitlines()


def serve_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if "/vae-service serve " in line]
    return line


def test_make_serve_installs_what_serving_needs_with_progress_and_says_how_big(tmp_path):
    lines = dry_run("serve", venv=tmp_path / "fresh")
    installs = [line for line in lines if " -m pip install " in line]
    assert len(installs) == 2 and all(" -q" not in line for line in installs)  # pip's own progress
    assert '"torch==2.13.0"' in installs[0] and installs[1].endswith("-e ./clients -e .")  # no [test] extra
    assert not [line for line in lines if "[test]" in line]
    assert any("torch.version.cuda" in line for line in lines)  # which torch build it got
    assert any("du -sh" in line for line in lines)  # how big the venv is
    assert serve_line(lines).endswith("serve --model sd --host 127.0.0.1 --port 8000 --grpc-port 0")


def test_make_serve_takes_grpc_port_and_a_torch_index(tmp_path):
    lines = dry_run("serve", "GRPC_PORT=9100", "TORCH_INDEX=https://download.pytorch.org/whl/cpu", venv=tmp_path / "v")
    assert serve_line(lines).endswith("--grpc-port 9100")
    assert any('"torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu' in line for line in lines)


def test_make_test_installs_the_test_tools_on_top(tmp_path):
    assert any(line.endswith('-e ./clients -e ".[test]"') for line in dry_run("install", venv=tmp_path / "v"))
