"""The largest batch that fits (`autopar.max_batch`, `autopar inspect --max-batch`), on one process."""

from __future__ import annotations

import functools
import json

import pytest

import autopar
from autopar import cli
from autopar.cli_common import build_hf
from autopar.program.build import capture, resolve_cost_model
from passes.search import strategy as S
from passes.options import Options

LIMIT = 2**30
SMALL = {"n_layer": 4}  # at 2 or 3 blocks the logits set the peak: recomputation would not raise the batch
SEQ = 64


def _make(batch):
    return build_hf("gpt2", SMALL, batch, SEQ)


@pytest.fixture(scope="module")
def capacities():
    return autopar.max_batch(_make, (2, 2), LIMIT)


@functools.lru_cache(maxsize=None)
def _captured(batch):
    """The graph at `batch`, captured once for every scheme and setting that estimates it (a capture
    of GPT-2 is the slow part of an estimate; the estimate does not change the graph)."""
    model, args, kwargs = _make(batch)
    return capture(model, args, kwargs).gm


def _memory(scheme_grid, strategy, recompute, batch):
    gm = _captured(batch)
    opts = Options(strategy=strategy, recompute="blocks" if recompute else False)
    return S.estimate_fixed(gm, scheme_grid, resolve_cost_model(None), strategy, opts).memory_bytes


def test_fixed_schemes_fit_at_their_batch_and_not_one_step_above(capacities):
    """Catches a linear fit that is off (activations not linear in the batch, parameters counted per
    sequence): for 2d and 1d x dp, with and without recomputation, the estimate at the batch reported
    fits the limit and the next multiple of the grid's rows does not."""
    for c in capacities:
        if c.scheme not in ("2d", "1d x dp"):
            continue
        step = c.grid[0]
        assert c.batch > 0, c
        assert _memory(c.grid, "2d" if c.scheme == "2d" else "1d", c.recompute, c.batch) <= LIMIT, c
        assert _memory(c.grid, "2d" if c.scheme == "2d" else "1d", c.recompute, c.batch + step) > LIMIT, c


def test_orderings_that_must_hold(capacities):
    """Recomputation never lowers the largest batch; auto's space holds fixed 2d and 1d x dp on the same
    grid, so its batch is at least theirs; 2D holds a quarter of the weights per rank on 2x2."""
    by = {(c.scheme, c.recompute): c for c in capacities}
    assert {s for s, _ in by} == set(autopar.planning.capacity.SCHEMES)
    for scheme in autopar.planning.capacity.SCHEMES:
        assert by[(scheme, True)].batch >= by[(scheme, False)].batch, scheme
    for rc in (False, True):
        assert by[("auto", rc)].batch >= max(by[("2d", rc)].batch, by[("1d x dp", rc)].batch)
        assert by[("auto", rc)].memory_bytes <= LIMIT
    assert by[("2d", True)].batch > by[("2d", False)].batch
    assert by[("1d", False)].grid == (1, 4) and by[("1d x dp", False)].grid == (2, 2)


def test_cli_max_batch_json_and_refusals(capsys):
    """`inspect --max-batch` prints one record per scheme and setting; without a limit, or with a
    module:callable that cannot be rebuilt at other batch sizes, it says what it needs."""
    argv = ["inspect", "gpt2", "--set", "n_layer=2", "--seq", str(SEQ), "--grid", "2x2", "--memory-limit", "1GiB",
            "--max-batch", "--json"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["scheme"], r["recompute"]) for r in rows} == {(s, rc) for s in autopar.planning.capacity.SCHEMES
                                                              for rc in (False, True)}
    with pytest.raises(SystemExit, match="needs --memory-limit SIZE and --grid RxC"):
        cli.main(["inspect", "gpt2", "--max-batch"])
    with pytest.raises(SystemExit, match="needs a transformers model type"):
        cli.main(["inspect", "examples.models:x", "--max-batch", "--memory-limit", "1GiB"])


def test_max_batch_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"memory_limit=0: expected a positive number of bytes per rank"):
        autopar.max_batch(_make, (2, 2), 0)
    with pytest.raises(ValueError, match=r"schemes=\['3d'\]: expected some of"):
        autopar.max_batch(_make, (2, 2), LIMIT, schemes=("3d",))


def test_max_batch_shows_progress_on_stderr(capsys, monkeypatch):
    """--max-batch ran two minutes without a word: a bar on rank 0's stderr names the scheme it is on
    (shown at once here: AUTOPAR_PROGRESS_DELAY=0; by default after 2 s), and progress=False is silent."""
    monkeypatch.setenv("AUTOPAR_PROGRESS_DELAY", "0")
    autopar.max_batch(_make, (2, 2), LIMIT, schemes=("2d",), recompute=(False,))
    said = capsys.readouterr().err
    assert "autopar max_batch" in said and "2d" in said, said
    autopar.max_batch(_make, (2, 2), LIMIT, schemes=("2d",), recompute=(False,), progress=False)
    assert "autopar max_batch" not in capsys.readouterr().err
