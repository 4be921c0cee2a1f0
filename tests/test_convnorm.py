"""Grouped and depthwise convolutions and batch norm on the grid: a small CNN in train mode (2 SGD
steps, running statistics, then eval) against the unmodified model on one process, every rank."""

import pytest

from tests import checks_convnorm as C
from tests.compare import assert_every_rank


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
def test_cnn_trains_at_parity_with_nothing_gathered(pool4, grid):
    """Catches a depthwise/grouped conv run on the wrong channel block, batch statistics taken over one
    row's samples only (2x2 splits the batch over 2 rows), running statistics not updated or updated
    from a partial batch, a bias-free or affine-free norm mishandled, a conv, norm or pooling op that
    falls back, and an ordinary conv's weight held whole over the rows."""
    res = pool4.run(C.cnn_parity, grid)
    assert_every_rank([r["excess"] for r in res], f"cnn {grid}")
    for rank, r in enumerate(res):
        assert not r["fallbacks"], (rank, r["fallbacks"])
        assert r["planned"] == r["counted"], (rank, r["planned"], r["counted"])
        assert r["kernels"] == ["SplitBatchNorm", "SplitConv"], (rank, r["kernels"])
        # the ordinary conv of 8 input channels and the grouped one of 2 per group: 1/4 per rank at 2x2;
        # the stem (3 input channels) and the depthwise conv (1 per group) over the columns only
        assert (r["held"]["mix.weight"], r["held"]["pw.weight"]) == (8 * 8 * 9 // 4, 8 * 2 // 4), r["held"]
        assert (r["held"]["stem.weight"], r["held"]["dw.weight"]) == (8 * 3 * 9 // grid[1], 8 * 9 // grid[1]), r["held"]
        names = set(r["excess"])
        assert {"buffer after 2 steps bn1.running_mean", "grad bn2.weight", "eval logits"} <= names, names
