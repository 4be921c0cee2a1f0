"""The README's quick start and the guide's figures are the code's: the quick start in the README is
examples/quickstart.py, which runs on 4 ranks with one process's losses; the `explain` sample of the
guide's Planning page is what `autopar.explain` prints for the model it names. Regenerate the sample
with `python -m tests.test_readme`."""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "docs", "guide", "planning.md")  # the page that holds the explain sample
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
MARK = "<!-- explain sample: `python -m tests.test_readme` writes it, tests/test_readme.py checks it -->"


def readme_explain(rank):
    """`autopar.explain` of the guide's model: the one-layer GPT of examples/models.py (hidden 64,
    4 heads, vocab 256, batch 8 x 32 tokens) on a 2x2 grid."""
    import autopar
    from models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_seq=32, hidden=64, heads=4, layers=1)
    ids = torch.randint(0, cfg.vocab_size, (8, 32))
    pmodel = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, ids))
    return autopar.explain(pmodel), autopar.explain(pmodel, verbose=True)


def _span(text: str) -> tuple:
    """Start and end offsets of the code block after MARK in the page."""
    at = text.index(MARK)
    start = text.index("```\n", at) + 4
    return start, text.index("\n```", start)


def test_readme_explain_sample_is_what_the_code_prints(pool4):
    """The README's sample said `total 865.3 KiB` while the code printed 857.3 KiB: a figure typed by
    hand drifts from the code it describes."""
    printed, verbose = pool4.run(readme_explain)[0]
    text = open(README).read()
    start, end = _span(text)
    assert text[start:end] == printed, "the guide's explain sample is stale: run `python -m tests.test_readme`"
    # the default lists the rows that move bytes; verbose=True every op, with the same totals
    shown, every = printed.splitlines(), verbose.splitlines()
    hidden = next(line for line in shown if line.startswith("(") and "move no bytes" in line)
    assert len(every) == len(shown) - 1 + int(hidden[1:].split()[0]), (hidden, len(every), len(shown))
    cells = lambda lines: {" ".join(line.split()) for line in lines}  # noqa: E731 (widths differ)
    assert cells(shown[2:]) - cells([hidden]) <= cells(every[2:]), "a row of the default is not in verbose"
    assert "arange" in verbose and "arange" not in printed  # an op that moves no bytes
    assert shown[-3:] == every[-3:], (shown[-3:], every[-3:])


def test_readme_quick_start_is_the_example_file():
    """The quick start used MyGPT, cfg and targets without defining them: it is now a file that runs, and
    the README shows that file as it is."""
    text = open(os.path.join(ROOT, "README.md")).read()
    mark = "<!-- runs: tests/test_readme.py::test_quickstart_runs_on_4_ranks_as_one_process -->\n```python\n"
    block = text.split(mark, 1)[1].split("```\n", 1)[0]
    assert block == open(QUICKSTART).read(), "README's quick start differs from examples/quickstart.py"


def test_quickstart_runs_on_4_ranks_as_one_process():
    """`torchrun --nproc-per-node 4 examples/quickstart.py`, as the README says, prints each step's loss;
    they equal the same model's on one process (same seed, batches, AdamW and clipping) within fp32
    parity (the losses are printed to 6 decimals)."""
    import re
    import subprocess

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import quickstart as Q

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", "29561", QUICKSTART], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 3, run.stdout
    assert "bytes received per rank per training step" in run.stdout, run.stdout
    torch.manual_seed(0)
    model = Q.TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = []
    for step in range(3):
        _, loss = model(*Q.batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for step, (got, w) in enumerate(zip(losses, want)):
        assert abs(got - w) <= 1e-6 + 1e-5 * abs(w), f"step {step}: loss {got} on 4 ranks, {w} on one process"


def _write(rank, out):
    text, _ = readme_explain(rank)
    if rank == 0:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    import tempfile

    from autopar.launch import spawn

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    out = os.path.join(tempfile.mkdtemp(), "explain.txt")
    spawn(_write, 4, out)
    text = open(README).read()
    start, end = _span(text)
    with open(README, "w") as f:
        f.write(text[:start] + open(out).read() + text[end:])
    print(f"{README}: explain sample regenerated")
