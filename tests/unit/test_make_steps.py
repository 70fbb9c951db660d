"""`make test` says what each of its steps runs and costs before it runs, and how long it took
after (before: no duration at all, and a silent minute installing the test tools)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent


def test_every_step_of_make_test_is_announced_and_timed():
    # the install stamps taken as made (-o): a pyproject newer than them adds the install recipe here
    stamps = [f"-o{VENV}/.installed", f"-o{VENV}/.installed-serving"]
    dry = subprocess.run(
        ["make", "-n", *stamps, "test", f"VENV={VENV}"], cwd=REPO, capture_output=True, text=True, check=True
    )
    steps = [line for line in dry.stdout.splitlines() if f"{VENV}/bin/" in line and "pip install" not in line]
    assert len(steps) >= 5, dry.stdout  # ruff twice, hadolint, the unit suite, the Ray suites
    for step in steps:
        assert step.startswith("tests/timed.sh "), step
    assert any("pytest tests/unit" in step for step in steps) and any("--ignore=tests/unit" in step for step in steps)


def test_a_timed_step_says_what_runs_then_how_long_it_took_and_keeps_its_exit_status():
    run = subprocess.run(
        ["tests/timed.sh", "a step", "2 s", "sh", "-c", "echo working; exit 3"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 3
    assert lines[0] == "== a step: about 2 s on a 2-core CPU: sh -c echo working; exit 3"
    assert lines[1] == "working"
    assert lines[2].startswith("== a step: took ") and lines[2].endswith(" s (exit status 3)")


def test_the_test_tools_install_says_what_it_installs():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("$(INSTALLED): ") :].split("\n\n")[0]
    steps = makefile[makefile.index("define install_into_venv") :].split("endef")[0]
    assert "pip install" in steps and " -q " not in steps
    assert "@echo" in recipe and " -q " not in recipe  # pip's own progress, not a silent minute
