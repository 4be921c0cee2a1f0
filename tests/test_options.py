"""One set of options: validated once, with one set of defaults, read the same by every stage."""

import argparse
import importlib
import inspect

import pytest
import torch
import torch.nn as nn

import autopar
from passes import ShardingError, capture, propagate
from passes.options import OPTION, OPTIONS, Options
from tests import checks_options as C


@pytest.mark.parametrize("option, value, text", [
    ("lowering", "cannon", "lowering='cannon': expected one of ('auto', 'broadcast', 'allgather', 'ring'); pass one of "
                         "these, or leave lowering out for the default 'auto'"),
    ("indivisible", "pad", "indivisible='pad': expected one of ('uneven', 'replicate', 'error')"),
    ("fused", "concat", "fused='concat': expected one of ('regroup', 'interleave')"),
    ("on_unsupported", "skip", "on_unsupported='skip': expected one of ('replicate', 'error')"),
    ("strategy", "2.5d", "strategy='2.5d': expected '2d' (SUMMA), '1d'"),
    ("cost_model", 3, "cost_model=3: expected None (published GPU-cluster figures), the path or dict"),
    ("memory_limit", 0, "memory_limit=0: expected a positive number of bytes per rank"),
    ("search_budget", -1, "search_budget=-1: expected seconds >= 0 (e.g. 30) or None for no time limit"),
    ("check_inputs", 1, "check_inputs=1: expected True (compare every call's inputs"),
    ("timeout", 0, "timeout=0: expected a positive number of seconds, or None"),
    ("optimizer_states", -1, "optimizer_states=-1: expected the number of tensors the optimizer keeps"),
    ("overlap", "yes", "overlap='yes': expected 'auto' (on where the cost model's `hidden` share is above 0)"),
    ("data_parallel", "zero3", "data_parallel='zero3': expected 'replicate' (every replica holds its grid block "
                               "whole), 'shard' (FSDP2's fully_shard over the replicas"),
])
def test_every_bad_option_is_named(option, value, text):
    """Catches an option that goes unchecked until a pass misreads it (propagate used to take any
    indivisible but 'replicate' as 'error'), and an error that does not say what to pass."""
    with pytest.raises(ValueError) as e:
        Options(**{option: value})
    assert text in str(e.value), str(e.value)


@pytest.mark.parametrize("fn", [autopar.parallelize, autopar.plan, autopar.choose_grid])
def test_keyword_defaults_are_the_options_defaults(fn):
    """Catches the entry points drifting apart again (propagate defaulted to indivisible='error' while
    parallelize defaulted to 'replicate')."""
    defaults = Options()
    params = inspect.signature(fn).parameters
    shared = [name for name, _ in defaults.items() if name in params]
    assert len(shared) >= 5, shared
    for name in shared:
        assert params[name].default == getattr(defaults, name), name


def test_parallelize_keywords_are_the_declared_options():
    """Catches an option declared in passes/options.py that parallelize does not take (or a keyword it
    takes that is declared nowhere), and a keyword whose default or type drifted from its declaration.
    `pipeline` is no compile option: it cuts the model into stages before any is compiled
    (`autopar.parallel.pipeline`)."""
    params = [p for p in inspect.signature(autopar.parallelize).parameters.values()
              if p.kind is p.KEYWORD_ONLY and p.name != "pipeline"]
    assert [(p.name, p.default, p.annotation) for p in params] \
        == [(o.name, o.default, o.type) for o in OPTIONS if o.keyword]


@pytest.mark.parametrize("fn", [autopar.plan, autopar.choose_grid])
def test_planning_keywords_are_declared_alike(fn):
    """Catches plan or choose_grid giving an option a default or type of its own (plan's cost_model
    was unannotated while Options typed it), so that a planned and a parallelized model differ."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY and p.name in OPTION]
    assert len(params) >= 5, [p.name for p in params]
    for p in params:
        assert (p.default, p.annotation) == (OPTION[p.name].default, OPTION[p.name].type), p.name


class _Built(Exception):
    """Raised in place of building `Options`, carrying the keywords it was given."""


# a valid value other than the default, for the options whose values are not a few choices
OTHER = {"cost_model": "calibration.json", "memory_limit": 2.0**30, "search_budget": 5.0, "timeout": 60.0,
         "optimizer_states": 1, "grad_bucket_mb": 1.0, "fsdp_prefetch": 2, "recompute_blocks": 2,
         "context_parallel": 2}


def _other(name):
    o = OPTION[name]
    return next(c for c in o.choices if c != o.default) if o.choices else OTHER[name]


@pytest.mark.parametrize("fn, home", [(autopar.parallelize, "autopar.parallel.api"),
                                      (autopar.plan, "autopar.planning.plan"),
                                      (autopar.choose_grid, "autopar.planning.plan")])
def test_every_option_keyword_reaches_options(fn, home, monkeypatch):
    """Catches a keyword that the entry point takes but drops when it builds `Options` (the option
    then silently keeps its default): each is called with a value other than its default."""
    def built(**kw):
        raise _Built(kw)

    monkeypatch.setattr(importlib.import_module(home), "Options", built)
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY and p.name in OPTION]
    given = {name: _other(name) for name in names}
    grid = (4,) if fn is autopar.choose_grid else ((2, 2),)  # choose_grid takes a device count
    with pytest.raises(_Built) as e:
        fn(nn.Linear(8, 8), *grid, (torch.randn(4, 8),), **given)
    assert {k: v for k, v in e.value.args[0].items() if k in given} == given


def test_plan_validates_like_parallelize():
    """plan used to accept any lowering, indivisible or fused value and fail (or not) deep inside."""
    expected = r"lowering='cannon': expected one of \('auto', 'broadcast', 'allgather', 'ring'\)"
    with pytest.raises(ValueError, match=expected):
        autopar.plan(nn.Linear(8, 8), grid=(2, 2), example_inputs=(torch.randn(4, 8),), lowering="cannon")
    with pytest.raises(ValueError, match="memory_limit=-1: expected a positive number"):
        autopar.choose_grid(nn.Linear(8, 8), 4, (torch.randn(4, 8),), memory_limit=-1)


def test_propagate_reads_the_options_it_is_given():
    """A Linear(16, 7) on a 2x2 grid: with the defaults (parallelize's) the 7 out-features are split in
    torch.chunk blocks (4, 3); with indivisible='replicate' the weight runs unsplit as a fallback; with
    indivisible='error' propagate raises, naming the way out."""
    cap = capture(nn.Linear(16, 7), (torch.randn(4, 16),))
    res = propagate(cap.gm, (2, 2))
    assert res.gathering_fallbacks == [] and str(res.param_layouts["weight"]) == "S(1)S(0)"
    cap = capture(nn.Linear(16, 7), (torch.randn(4, 16),))
    assert [n.name for n, *_ in propagate(cap.gm, (2, 2), Options(indivisible="replicate")).gathering_fallbacks] \
        == ["linear"]
    cap = capture(nn.Linear(16, 7), (torch.randn(4, 16),))
    with pytest.raises(ShardingError, match="indivisible='replicate'"):
        propagate(cap.gm, (2, 2), Options(indivisible="error"))


def test_parallel_module_accessors(pool4):
    """Catches graph_module raising before the first call (it read the last call's program only), and
    accessors that disagree with what the model was built from."""
    for rank, r in enumerate(pool4.run(C.accessors)):
        assert r["graph before the first call"], rank
        assert r["first signature"] == (True, (), ((4, 8), torch.float32)), (rank, r["first signature"])
        assert r["source model"] and r["materialized"], rank
        assert r["persistent buffers"] == ["scale"], (rank, r["persistent buffers"])
        assert r["signature after a call"] == (True, (), ((8, 8), torch.float32)), rank
        assert r["graph follows the call"], rank


@pytest.mark.parametrize("given,bytes_", [("8GiB", 8 * 2**30), ("500MB", 500 * 10**6), ("1.5 GiB", 1.5 * 2**30),
                                          ("64kib", 64 * 2**10), ("2TB", 2 * 10**12), (40 * 2**30, 40 * 2**30)])
def test_memory_limit_takes_a_size_with_a_unit(given, bytes_):
    """memory_limit was bytes in Python and GiB on the command line; a string with a unit reads the same
    in both and every stage gets bytes."""
    assert Options(memory_limit=given).memory_limit == bytes_


def test_a_memory_limit_is_printed_with_its_unit():
    """memory_limit=8 (bytes, meant as GiB) reported 'memory_limit=0.00 GiB ... is 0.00 GiB'."""
    from passes.options import format_bytes

    assert [format_bytes(n) for n in (8, 1536, 3 * 2**20, 8 * 2**30)] == ["8 B", "1.5 KiB", "3.0 MiB", "8.00 GiB"]
    with pytest.raises(ValueError, match=r"memory_limit='8 parsecs': expected .* a string with a unit \('40GiB'"):
        Options(memory_limit="8 parsecs")


def test_the_command_line_reads_the_same_sizes():
    """--memory-limit took GiB where memory_limit= takes bytes; both read '80GiB' now, and a plain
    number on the command line that cannot be meant as bytes asks whether GiB was meant."""
    from autopar import cli

    assert cli.parse_size("80GiB") == 80 * 2**30 and cli.parse_size(str(2**31)) == 2**31
    with pytest.raises(argparse.ArgumentTypeError, match="'80' is 80 bytes per rank.*did you mean 80GiB"):
        cli.parse_size("80")


def test_missing_example_inputs_name_the_argument():
    """Without example inputs torch.export failed inside the model ('missing a required argument' for a
    module; transformers' 'You must specify exactly one of input_ids or inputs_embeds'), reported as
    data-dependent control flow. Checked before any process group is needed."""
    import transformers

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, mask):
            return self.lin(x) * mask

    with pytest.raises(ValueError, match=r"autopar.parallelize: the example inputs do not fit Two.forward\(x, mask\): "
                                         r"missing a required argument: 'mask'.*example_inputs=\(\.\.\.\)"):
        autopar.parallelize(Two(), grid=(1, 1), example_inputs=(torch.randn(2, 8),))
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    with pytest.raises(ValueError, match=r"autopar.plan needs example inputs and got none.*"
                                         r"example_kwargs=dict\(input_ids=ids, labels=ids\)"):
        autopar.plan(transformers.GPT2LMHeadModel(cfg), grid=(2, 2))


def test_a_plan_prints_short_and_explains():
    """print(plan) dumped every row and parameter (54,700 characters for a small Llama) and
    explain(plan) raised AttributeError: the repr is a summary, explain prints the op table and totals."""
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    pl = autopar.plan(model, grid=(2, 2), example_inputs=(torch.randn(4, 8, 16),))
    assert len(repr(pl)) < 300 and repr(pl).startswith("Plan(grid 2x2, strategy '2d': "), repr(pl)
    text = autopar.explain(pl)
    assert "SummaLinear(AB" in text and "grid 2x2, per rank per training step" in text, text
    assert f"received in {pl.collectives_per_rank_per_step} collective calls" in text, text
    with pytest.raises(ValueError, match="autopar.explain takes what autopar.parallelize returns"):
        autopar.explain(model)


def test_overlap_sets_the_runtime_and_the_price():
    """Catches an `overlap` option that does not reach the runtime (the grid's panel prefetch and weight-
    gradient overlap stay on under overlap=False, so the benchmark's in-line baseline would overlap), an
    'auto' that ignores the cost model, and an estimate that prices overlap=False's in-line transfers as
    hidden: 'auto' follows the model's `hidden` share; with nothing hidden the broadcast lowering's 2D
    step costs more than with its transfers behind the matmuls, and no less than the all-gather one's
    bytes added to its compute."""
    from passes.compile import compile_captured
    from passes.cost.model import DEFAULT, CostModel
    from passes.mesh import Grid
    from passes.search.strategy import estimate_fixed

    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = (torch.randn(32, 64),)
    hides_none = dict(DEFAULT, hidden=0.0)
    for options, on in ((Options(), True), (Options(overlap=False), False),
                        (Options(cost_model=hides_none), False), (Options(overlap=True, cost_model=hides_none), True)):
        g = Grid.for_planning(2, 2)
        compile_captured(capture(model, x), (), g, options)
        assert g.prefetch is on and g.overlap_grad_reduce is on, (options.overlap, options.cost_model, on)
    gm = capture(model, x).gm
    cm = CostModel.resolve(None)
    on, off = (estimate_fixed(gm, (2, 2), cm, "2d", Options(overlap=v), lowering="broadcast").time_s
               for v in (True, False))
    assert off > on, (on, off)
    assert CostModel.resolve(hides_none).hidden == 0.0 and cm.hidden == 1.0
