"""The collective layer on real gloo ranks: group membership, SUMMA products, redistributions."""

import pytest

from tests import checks_comm as C

TOL = 1e-4


def test_group_mapping_2x2(pool4):
    """Catches the DeviceMesh naming trap: get_group(0) is the group that shares a *column* index."""
    res = pool4.run(C.groups, 2)
    for rank, r in enumerate(res):
        row, col = divmod(rank, 2)
        assert r["r, c"] == (row, col)
        assert r["same_row"] == [row * 2 + i for i in range(2)], r
        assert r["same_col"] == [i * 2 + col for i in range(2)], r


@pytest.mark.parametrize("lowering", ["broadcast", "allgather"])
def test_summa_products_2x2(pool4, lowering):
    """Catches a wrong broadcast source, a reduce onto the wrong member or a transposed block."""
    for rank, errs in enumerate(pool4.run(C.summa_products, 2, lowering)):
        assert max(errs.values()) < TOL, f"rank {rank}: {errs}"


def test_redistributions_2x2(pool4):
    """Catches a collective over the wrong axis, a missing 1/q for averages, a backward that is not
    the adjoint of its forward."""
    for rank, bad in enumerate(pool4.run(C.redistributions, 2)):
        assert not bad, f"rank {rank}: (src, dst, fwd err, bwd err): {bad}"


def test_group_mapping_and_products_3x3(pool9):
    """q=3: members 0..2 of each group, three SUMMA steps."""
    res = pool9.run(C.groups, 3)
    for rank, r in enumerate(res):
        row, col = divmod(rank, 3)
        assert r["same_row"] == [row * 3 + i for i in range(3)]
        assert r["same_col"] == [i * 3 + col for i in range(3)]
    for lowering in ("broadcast", "allgather"):
        for rank, errs in enumerate(pool9.run(C.summa_products, 3, lowering)):
            assert max(errs.values()) < TOL, f"rank {rank} {lowering}: {errs}"
    for rank, bad in enumerate(pool9.run(C.redistributions, 3)):
        assert not bad, f"rank {rank}: {bad}"
