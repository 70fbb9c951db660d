"""The examples of README.md and docs/ (tests/doc_examples.py reads them from the Markdown): each
says what it runs against, and what cannot run here is at least checked against the code.
tests/integration/test_newcomer.py runs the rest as written."""

import ast
import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_examples import KINDS, REPO, all_examples

EXAMPLES = all_examples()
VAE_SERVICE = Path(sys.executable).with_name("vae-service")


def test_the_reader_finds_the_examples_the_documents_show():
    assert {e.document for e in EXAMPLES} >= {"README.md", "docs/interfaces.md", "docs/ray-native.md"}
    assert {e.language for e in EXAMPLES} == {"python", "shell", "yaml"}
    assert len(EXAMPLES) >= 15


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.id)
def test_every_example_says_what_it_runs_against(example):
    assert example.tag is not None, f"{example.id}: add <!-- example: KIND --> before it, KIND one of {KINDS}"
    assert example.kind in KINDS, f"{example.id}: {example.tag!r} is not one of {KINDS}"
    if example.kind == "fragment":
        assert len(example.tag.split(":", 1)[1].strip()) > 10, f"{example.id}: say what the fragment needs"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.language == "python"], ids=lambda e: e.id)
def test_every_python_example_parses(example):
    compile(example.code, example.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.language == "yaml"], ids=lambda e: e.id)
def test_every_yaml_example_is_a_valid_service_config(example):
    import yaml

    from vae_service.config import ServiceConfig

    ServiceConfig.model_validate(yaml.safe_load(example.code))


@functools.cache
def help_of(command: str) -> str:
    run = subprocess.run([str(VAE_SERVICE), command, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


CLI_COMMANDS = [
    (e, command)
    for e in EXAMPLES
    if e.language == "shell"
    for command in e.commands()
    if command.startswith("vae-service ")
]


@pytest.mark.parametrize("example, command", CLI_COMMANDS, ids=[f"{e.id} {c[:40]}" for e, c in CLI_COMMANDS])
def test_every_vae_service_command_shown_uses_its_own_flags(example, command):
    words = shlex.split(command)
    flags = {word.split("=")[0] for word in words if word.startswith("--")}
    usage = help_of(words[1])
    assert not [flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", usage)], usage


def test_the_readmes_set_up_commands_are_what_ci_and_the_newcomer_test_run():
    (setup,) = [e for e in EXAMPLES if e.kind == "set-up"]
    assert setup.document == "README.md" and setup.commands() == ["make serve", "make test"]
    assert re.search(r"^make test\b", (REPO / ".ci/run").read_text(), re.M)
    readme = (REPO / "README.md").read_text()
    # the shell the examples run in: the venv's bin on PATH, the README's first decode in its python
    assert "`source .venv/bin/activate`" in readme and "in `.venv/bin/python`" in readme
    newcomer = (REPO / "tests/integration/test_newcomer.py").read_text()
    assert 'make("serve", f"PORT=' in newcomer  # `make serve` with only its port (and gRPC's) chosen
