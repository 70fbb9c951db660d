"""Every example README.md and docs/ show, read from the Markdown, so that an example added there
cannot go untested: a fenced block with a language, or an indented block (shell commands, or
Python). Each
carries a tag on the line before it (before the blank line, for an indented block) saying what it
runs against, which tests/integration/test_newcomer.py runs it as:

    <!-- example: make serve -->                    the service `make serve` starts (the sd preset)
    <!-- example: make serve MODEL=tiny-wan -->     the tiny video preset's service
    <!-- example: standalone -->                    no service: run in a new shell
    <!-- example: set-up -->                        the README's two set-up commands (what CI runs)
    <!-- example: fragment: WHY -->                 part of a program, or a command needing what
                                                    WHY names: Python must parse, a vae-service
                                                    command's flags must be the command's own, and
                                                    YAML must be a valid ServiceConfig

Shell examples run in a folder holding `latents.npy` and `latents/` (random latents of the served
model's shape), the files they name, with the venv's bin on PATH, as the README says to.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))
SERVICES = ("make serve", "make serve MODEL=tiny-wan")
KINDS = (*SERVICES, "standalone", "set-up", "fragment")
COMMANDS = ("make ", "vae-service ", "curl ", "serve ", "eval ", "pip ", "python ")
SHELLS = ("bash", "sh", "shell", "console")

_TAG = re.compile(r"<!-- example: (.*?) -->")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclasses.dataclass(frozen=True)
class Example:
    document: str
    line: int  # 1-based, of the first line of code
    language: str  # python, shell (commands), or a fence's own (yaml)
    code: str
    tag: str | None  # the tag's text, or None where the block has none

    @property
    def kind(self) -> str | None:
        return None if self.tag is None else self.tag.split(":")[0].strip()

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"

    def commands(self) -> list[str]:
        """A shell block's commands, one a line, without their trailing comments (`  # ...`)."""
        return [re.split(r"\s{2,}#", line)[0].strip() for line in self.code.splitlines() if line.strip()]


def _tag_before(lines: list[str], index: int) -> str | None:
    """The tag on the line before `index`, skipping one blank line."""
    for back in (index - 1, index - 2):
        if back < 0:
            return None
        match = _TAG.search(lines[back])
        if match:
            return match[1].strip()
        if lines[back].strip():
            return None
    return None


def examples_in(document: str) -> list[Example]:
    lines = (REPO / document).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if fence[2]:  # a bare fence holds a diagram or a listing, not something to run
                language = "shell" if fence[2] in SHELLS else fence[2]
                code = "\n".join(line[len(fence[1]) :] for line in lines[i + 1 : end])
                found.append(Example(document, i + 2, language, code, _tag_before(lines, i)))
            i = end + 1
            continue
        if lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and lines[end].startswith("    "):
                end += 1
            code = "\n".join(line[4:] for line in lines[i:end])
            language = "shell" if code.startswith(COMMANDS) else "python"
            found.append(Example(document, i + 1, language, code, _tag_before(lines, i)))
            i = end
            continue
        i += 1
    return found


def all_examples() -> list[Example]:
    return [example for document in DOCUMENTS for example in examples_in(document)]
