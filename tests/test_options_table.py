"""The README's option table is the declaration's: `passes.options.markdown_table()` renders it from
passes/options.py. Regenerate it with `python -m tests.test_options_table`."""

from __future__ import annotations

import os

from passes.options import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BEGIN = "<!-- options-table: `python -m tests.test_options_table` writes it from passes/options.py -->\n"
END = "<!-- /options-table -->"


def _span(text: str) -> tuple:
    """Start and end offsets of the table between the markers in the README."""
    start = text.index(BEGIN) + len(BEGIN)
    return start, text.index(END, start)


def test_readme_option_table_is_the_declaration():
    """Catches the README's option table drifting from passes/options.py: a default, a choice or an
    option added there and not here (the README listed eleven options while parallelize took fourteen)."""
    text = open(README).read()
    start, end = _span(text)
    assert text[start:end] == markdown_table(), \
        "README.md's option table differs from passes/options.py: run `python -m tests.test_options_table`"


if __name__ == "__main__":
    text = open(README).read()
    start, end = _span(text)
    with open(README, "w") as f:
        f.write(text[:start] + markdown_table() + text[end:])
    print(f"{README}: option table regenerated")
