"""einsum split on its subscripts: the rule against the one-process oracle (tests/test_rules_oracle.py),
then forward and backward on gloo grids against the unmodified model, element-wise on every rank.
Funnel's relative attention is written with einsum; it ran whole on every rank before (1.38/p)."""

from __future__ import annotations

import pytest
import torch

from passes.rules.einsum import parse
from tests import checks_rules as C
from tests.compare import assert_every_rank
from tests.test_rules_oracle import QS, check_local_rules

aten = torch.ops.aten


@pytest.mark.parametrize("q", QS)
def test_einsums_against_the_oracle(q):
    """Catches a letter split on one operand and not the other, a summed-out split letter not marked
    partial, and an output split on the wrong dim, on square and rectangular grids."""
    checked = check_local_rules(C.Einsums(), (torch.randn(C.B, C.S, C.H),), q, expect=(aten.einsum,))
    assert sum(n.startswith("einsum") for n in checked) == 8, checked


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
def test_einsums_forward_backward_parity(pool4, grid):
    """Outputs (one a scalar with every letter summed) and every gradient on every rank; no einsum
    falls back, and no weight is held whole."""
    res = pool4.run(C.einsum_parity, grid)
    assert_every_rank([r["excess"] for r in res], f"einsums {grid}")
    for rank, r in enumerate(res):
        assert r["gathered"] == [], (rank, r["gathered"])
        assert all(f < 1 for n, f in r["held"].items()), (rank, r["held"])


def test_parse():
    """Catches an implicit output in the wrong order, an ellipsis expanded to the wrong width or side."""
    assert parse("bind,jnd->bnij", [4, 3]) == (["bind", "jnd"], "bnij")
    assert parse("ji,jk", [2, 2]) == (["ji", "jk"], "ik")
    assert parse("bih,bih", [3, 3]) == (["bih", "bih"], "")
    assert parse("...qd,kd->...qk", [4, 2]) == (["ABqd", "kd"], "ABqk")
    assert parse("b...d,d", [3, 1]) == (["bAd", "d"], "Ab")
