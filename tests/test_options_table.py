"""The option tables of the README and of the guide's Training page are the declaration's:
`passes.options.markdown_table()` renders them from passes/options.py. Regenerate both with
`python -m tests.test_options_table`."""

from __future__ import annotations

import os

import pytest

from passes.options import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "guide", "training.md")]
BEGIN = "<!-- options-table: `python -m tests.test_options_table` writes it from passes/options.py -->\n"
END = "<!-- /options-table -->"


def _span(text: str) -> tuple:
    """Start and end offsets of the table between the markers."""
    start = text.index(BEGIN) + len(BEGIN)
    return start, text.index(END, start)


@pytest.mark.parametrize("path", TABLES, ids=os.path.basename)
def test_option_table_is_the_declaration(path):
    """Catches an option table drifting from passes/options.py: a default, a choice or an option added
    there and not here (the README listed eleven options while parallelize took fourteen)."""
    text = open(path).read()
    start, end = _span(text)
    assert text[start:end] == markdown_table(), \
        f"{path}'s option table differs from passes/options.py: run `python -m tests.test_options_table`"


if __name__ == "__main__":
    for path in TABLES:
        text = open(path).read()
        start, end = _span(text)
        with open(path, "w") as f:
            f.write(text[:start] + markdown_table() + text[end:])
        print(f"{path}: option table regenerated")
