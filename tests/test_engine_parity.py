"""Parity of the 2D engine with the unmodified model on one process, on real gloo ranks."""

import pytest

from tests import checks_engine as C
from tests.compare import ATOL_FRAC, RTOL, assert_every_rank, failures

SMALL = dict(vocab_size=64, max_seq=16, hidden=32, heads=4, layers=1)
SMALL3 = dict(vocab_size=72, max_seq=16, hidden=24, heads=6, layers=1)


def _assert_all_small(per_rank, what):
    """Every rank, every element: outputs, loss, gradients and parameters after the steps within
    RTOL relative plus ATOL_FRAC x the largest reference value of their group (outputs, gradients,
    parameters); the user's model left bit-identical; parameter names as the original model's."""
    for rank, r in enumerate(per_rank):
        assert r["names match"], f"{what}: rank {rank}: parameter names differ from the original model's"
    assert_every_rank([r["excess"] for r in per_rank], f"{what} (rtol {RTOL}, atol {ATOL_FRAC} x group max)")


@pytest.mark.parametrize("norm,mlp,lowering", [
    ("layernorm", "gelu", "broadcast"),
    ("rmsnorm", "swiglu", "broadcast"),
    ("layernorm", "gelu", "allgather"),
    ("rmsnorm", "swiglu", "ring"),
])
def test_gpt_parity_2x2(pool4, norm, mlp, lowering):
    """Catches any wrong forward value, gradient or optimizer state on a 2x2 grid: a SUMMA block
    taken from the wrong rank, a missing gradient all-reduce for a replicated bias or norm weight,
    a wrong local view size, a tied weight updated twice."""
    results = pool4.run(C.gpt_parity, 2, dict(SMALL, norm=norm, mlp=mlp), lowering)
    _assert_all_small(results, f"2x2 {norm} {mlp} {lowering}")


@pytest.mark.parametrize("lowering", ["broadcast", "allgather"])
def test_gpt_parity_2x2_in_line(pool4, lowering):
    """overlap=False, the in-line baseline (every transfer waited for before the compute that follows):
    the same parity with one process, forward, gradients and AdamW steps on every rank."""
    results = pool4.run(C.gpt_parity, 2, dict(SMALL, norm="rmsnorm", mlp="swiglu"), lowering, overlap=False)
    _assert_all_small(results, f"2x2 overlap=False {lowering}")


@pytest.mark.parametrize("norm,mlp,lowering", [("layernorm", "gelu", "broadcast"), ("rmsnorm", "swiglu", "broadcast"),
                                               ("rmsnorm", "swiglu", "ring")])
def test_gpt_parity_3x3(pool9, norm, mlp, lowering):
    """The same at q=3, where row and column groups have 3 members: catches index arithmetic that
    only happens to work for q=2 (e.g. source rank = 1 - r), and a ring step that is not a rotation."""
    _assert_all_small(pool9.run(C.gpt_parity, 3, dict(SMALL3, norm=norm, mlp=mlp), lowering, 6, 8, 3),
                      f"3x3 {norm} {mlp} {lowering}")


RECT = [  # (grid, config, batch, lowering): every split dim divisible by the axis that splits it
    ((1, 2), SMALL, 4, "broadcast"), ((2, 1), SMALL, 4, "broadcast"),
    ((1, 4), SMALL, 4, "allgather"), ((4, 1), SMALL, 4, "broadcast"),
    ((2, 3), SMALL3, 6, "broadcast"), ((2, 3), SMALL3, 6, "allgather"), ((3, 2), SMALL3, 6, "broadcast"),
    ((2, 3), SMALL3, 6, "ring"),
]


@pytest.mark.parametrize("grid,cfg,batch,lowering", RECT, ids=[f"{g[0]}x{g[1]}-{lo}" for g, _, _, lo in RECT])
def test_gpt_parity_rectangular(grid, cfg, batch, lowering):
    """Rectangular R x C grids: the contracted dim is split C ways in activations and R ways in
    weights, so the broadcast lowering cuts it at both sets of boundaries (2x3: 4 pieces). Catches
    a piece broadcast by the wrong member, an output piece reduced onto the wrong column, and any
    rule that checks divisibility against the wrong axis. 1xC is tensor parallelism with split
    activations; Rx1 is fully sharded data parallelism (weights gathered per use)."""
    from tests.conftest import get_pool

    pool = get_pool(grid[0] * grid[1])
    _assert_all_small(pool.run(C.gpt_parity, grid, dict(cfg, norm="rmsnorm", mlp="swiglu"), lowering, batch, 8, 2),
                      f"{grid} {lowering}")


@pytest.mark.parametrize("grid,strategy", [((2, 2), "auto"), ((1, 4), "1d"), ((2, 2), "1d")])
def test_gpt_parity_strategies(pool4, grid, strategy):
    """1D (Megatron column/row pairs, batch over the rows) and the auto plan through three AdamW steps:
    catches a missing input-gradient all-reduce of a column split, a bias added on every column of a
    row split, a weight gradient not summed over the batch rows."""
    _assert_all_small(pool4.run(C.gpt_parity, grid, dict(SMALL, norm="rmsnorm", mlp="swiglu"), "broadcast", 4, 8, 3,
                                strategy=strategy), f"{grid} {strategy}")


def test_drift_on_one_rank_is_seen(pool4):
    """Catches a parity check that reads rank 0 only: a replicated parameter copy nudged on rank 3
    (outside rank 0's row and column groups) must be reported on rank 3, and not on rank 0."""
    res = pool4.run(C.replicated_drift, 3)
    name = res[0][1]
    bad = failures([errs for errs, _ in res])
    assert (3, name) in bad, (name, bad)
    assert 0 not in {rank for rank, _ in bad}, bad
