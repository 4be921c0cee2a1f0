"""3D tensor parallelism's linear on a 2x2x2 cube of 8 gloo ranks (`passes.ops.cube`)."""

import pytest

from tests import checks_cube as C
from tests.compare import assert_every_rank


@pytest.mark.parametrize("lowering", ["broadcast", "ring"])
def test_two_linears_match_torch_and_move_the_3d_volume(lowering):
    """Y = X W1 then Z = Y W2 on 2x2x2, the second linear reading the first's output without any
    redistribution: values and the gradients of X, W1, W2 on every rank, element-wise; each rank holds
    1/8 of each weight; the bytes each linear receives forward and backward equal the 3D formula
    e(q-1)(MK + KN + MN)/q^3 and e(q-1)(2MK + 2KN + MN)/q^3 exactly, on every rank. Catches a weight
    block from the wrong depth, a partial sum not reduced over the depth, a backward that does not
    gather dY over the depth, and an extra collective."""
    from tests.conftest import get_pool

    res = get_pool(8).run(C.two_linears, 2, lowering)
    assert_every_rank([r["excess"] for r in res], f"3D linears on 2x2x2, {lowering}")
    assert sorted(r["at"] for r in res) == [(r, c, d) for r in range(2) for c in range(2) for d in range(2)]
    for rank, r in enumerate(res):
        assert r["counted"] == r["formula"], (rank, r["counted"], r["formula"])
        assert all(h * 8 == w for h, w in zip(r["held"], r["whole"])), (rank, r["held"], r["whole"])


def test_blocks_that_do_not_fit_are_refused():
    """A block whose contracted dim does not match the weight's, and an output dim the cube's q^2
    columns do not divide, raise a UsageError naming the sizes, on every rank alike."""
    from tests.conftest import get_pool

    for rank, r in enumerate(get_pool(8).run(C.refusals)):
        kind, msg = r["mismatch"]
        assert kind == "UsageError" and "K/4" in msg and "weight_block" in msg, (rank, msg)
        kind, msg = r["uneven N"]
        assert kind == "UsageError" and "N=6" in msg and "divisible by 4" in msg, (rank, msg)


def test_dimension_table_orders_the_volumes():
    """`autopar bench --dimensions`: every layout of a row holds the same parameter bytes (1/p of the
    linears'), 2D and 3D hold the same inputs, and at 512 ranks 3D receives less than 2D, which
    receives less than 1D, above the lower bound; at 64 ranks 3D (4x4x4) receives less than 2D (8x8).
    Catches a formula with p in place of q^3 or a layout priced at another rank count."""
    from autopar.bench.dimensions import table

    for name, per_p in table().items():
        for p, rows in per_p.items():
            one, two, three = rows.values()
            assert one["params"] == two["params"] == three["params"], (name, p)
            assert two["inputs"] == three["inputs"] < one["inputs"], (name, p)
            assert 1 < three["over_bound"] < two["over_bound"] < one["over_bound"], (name, p, rows)
            assert three["received"] < two["received"] < one["received"], (name, p, rows)
