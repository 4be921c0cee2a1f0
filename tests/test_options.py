"""One set of options: validated once, with one set of defaults, read the same by every stage."""

import inspect

import pytest
import torch
import torch.nn as nn

import autopar
from passes import ShardingError, capture, propagate
from passes.options import Options
from tests import checks_options as C


@pytest.mark.parametrize("option, value, text", [
    ("lowering", "ring", "lowering='ring': expected one of ('broadcast', 'allgather'); pass one of these, or "
                         "leave lowering out for the default 'broadcast'"),
    ("indivisible", "pad", "indivisible='pad': expected one of ('uneven', 'replicate', 'error')"),
    ("fused", "concat", "fused='concat': expected one of ('regroup', 'interleave')"),
    ("on_unsupported", "skip", "on_unsupported='skip': expected one of ('replicate', 'error')"),
    ("strategy", "3d", "strategy='3d': expected '2d' (SUMMA), '1d'"),
    ("cost_model", 3, "cost_model=3: expected None (published GPU-cluster figures), the path or dict"),
    ("memory_limit", 0, "memory_limit=0: expected a positive number of bytes per rank"),
    ("search_budget", -1, "search_budget=-1: expected seconds >= 0 (e.g. 30) or None for no time limit"),
    ("check_inputs", 1, "check_inputs=1: expected True (compare every call's inputs"),
    ("timeout", 0, "timeout=0: expected a positive number of seconds, or None"),
    ("optimizer_states", -1, "optimizer_states=-1: expected the number of tensors the optimizer keeps"),
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


def test_plan_validates_like_parallelize():
    """plan used to accept any lowering, indivisible or fused value and fail (or not) deep inside."""
    with pytest.raises(ValueError, match=r"lowering='ring': expected one of \('broadcast', 'allgather'\)"):
        autopar.plan(nn.Linear(8, 8), grid=(2, 2), example_inputs=(torch.randn(4, 8),), lowering="ring")
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
