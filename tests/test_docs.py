"""Every code block of the README and of the user guide (docs/index.md, docs/guide/, the
troubleshooting page) is run by a test or marked with why it is not: the line before it says
`<!-- runs: tests/file.py::test_name -->` (a test that exists) or `<!-- not run: reason -->`.
The site itself is built by `make docs` (mkdocs --strict: a broken link or anchor fails it)."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "docs/index.md", "docs/troubleshooting.md", *sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "guide", "*.md")))]
RUNS = re.compile(r"<!-- runs: (tests/[\w/]+\.py)::(\w+) -->")
NOT_RUN = re.compile(r"<!-- not run: (.+) -->")


def blocks(text: str) -> list:
    """(line number, the non-empty line before the block) of every fenced block's opening."""
    out, inside, before = [], False, ""
    for i, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            if not inside:
                out.append((i, before))
            inside = not inside
        elif line.strip() and not inside:
            before = line.strip()
    assert not inside, "a code block is not closed"
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_is_run_or_says_why_not(page):
    """Catches a snippet nobody runs (the README's quick start used names it never defined)."""
    for line, before in blocks(open(os.path.join(ROOT, page)).read()):
        runs, skip = RUNS.fullmatch(before), NOT_RUN.fullmatch(before)
        assert runs or skip, f"{page}:{line}: a code block with no `<!-- runs: ... -->` or `<!-- not run: why -->`"
        if skip:
            assert len(skip.group(1).split()) >= 3, f"{page}:{line}: say why it is not run: {before}"
        else:
            path, name = runs.groups()
            source = open(os.path.join(ROOT, path)).read()
            assert f"def {name}(" in source, f"{page}:{line}: {path} has no test {name}"


def test_the_readme_stays_short():
    """The README was 872 lines with no install or launch section: it is the entry point, at most
    ~250 lines; the rest is the guide."""
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    for section in ("## Install", "## Quick start", "## Launching", "## Options", "## The user guide"):
        assert section in text, section
