"""The collective layer on real gloo ranks: group membership, SUMMA products, redistributions."""

import pytest

from tests import checks_comm as C
from tests.compare import assert_every_rank


def _check_products(per_rank, grid):
    """Values on every rank, element-wise within tests/compare.py's RTOL plus an atol scaled to the
    full result; bytes received, summed over ranks, equal the analytic SUMMA volume on an R x C grid:
    every product moves (C-1)/C of one operand's row panels and (R-1)/R of the other's column panels
    (AB: A [M,K] and B [K,N]; ABT: B [N,K] and the [M,N] result; ATB: A and the [K,N] result), 4
    bytes per fp32 element."""
    R, C_ = grid
    M, K, N = 6 * R * C_, 4 * R * C_, 5 * R * C_
    want = {"AB": (C_ - 1) * M * K + (R - 1) * K * N,
            "ABT": (R - 1) * N * K + (C_ - 1) * M * N,
            "ATB": (C_ - 1) * M * K + (R - 1) * K * N}
    assert_every_rank([r["excess"] for r in per_rank], f"SUMMA products on {R}x{C_}")
    for name, elems in want.items():
        got = [r["bytes"][name] for r in per_rank]
        assert sum(got) == 4 * elems, (name, got)


def test_group_mapping_2x2(pool4):
    """Catches the DeviceMesh naming trap: get_group(0) is the group that shares a *column* index."""
    res = pool4.run(C.groups, 2)
    for rank, r in enumerate(res):
        row, col = divmod(rank, 2)
        assert r["r, c"] == (row, col)
        assert r["same_row"] == [row * 2 + i for i in range(2)], r
        assert r["same_col"] == [i * 2 + col for i in range(2)], r


@pytest.mark.parametrize("lowering", ["broadcast", "allgather", "ring"])
def test_summa_products_2x2(pool4, lowering):
    """Catches a wrong broadcast source, a reduce onto the wrong member or a transposed block."""
    _check_products(pool4.run(C.summa_products, 2, lowering), (2, 2))


def test_redistributions_2x2(pool4):
    """Catches a collective over the wrong axis, a missing 1/q for averages, a backward that is not
    the adjoint of its forward."""
    assert_every_rank(pool4.run(C.redistributions, 2), "redistributions on 2x2")


def test_group_mapping_and_products_3x3(pool9):
    """q=3: members 0..2 of each group, three SUMMA steps."""
    res = pool9.run(C.groups, 3)
    for rank, r in enumerate(res):
        row, col = divmod(rank, 3)
        assert r["same_row"] == [row * 3 + i for i in range(3)]
        assert r["same_col"] == [i * 3 + col for i in range(3)]
    for lowering in ("broadcast", "allgather", "ring"):
        _check_products(pool9.run(C.summa_products, 3, lowering), (3, 3))
    assert_every_rank(pool9.run(C.redistributions, 3), "redistributions on 3x3")


@pytest.mark.parametrize("grid", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 3), (3, 2)],
                         ids=lambda g: f"{g[0]}x{g[1]}")
def test_rectangular_groups_products_redistributions(grid):
    """R x C grids: group membership, SUMMA products in both lowerings (the broadcast lowering cuts
    the contracted dim at both the R-way and the C-way block boundaries) with their exact byte
    volume, and every redistribution. An axis of size 1 sends nothing."""
    from tests.conftest import get_pool

    R, C_ = grid
    pool = get_pool(R * C_)
    for rank, r in enumerate(pool.run(C.groups, grid)):
        row, col = divmod(rank, C_)
        assert r["r, c"] == (row, col)
        assert r["same_row"] == [row * C_ + i for i in range(C_)], r
        assert r["same_col"] == [i * C_ + col for i in range(R)], r
    for lowering in ("broadcast", "allgather", "ring"):
        _check_products(pool.run(C.summa_products, grid, lowering), grid)
    assert_every_rank(pool.run(C.redistributions, grid), f"redistributions on {R}x{C_}")


@pytest.mark.parametrize("grid,dims", [((2, 2), (8, 12, 8)), ((2, 3), (7, 10, 11)), ((1, 4), (4, 10, 7))],
                         ids=["2x2", "2x3-uneven", "1x4-uneven"])
def test_ring_lowering_moves_the_broadcast_bytes(grid, dims):
    """The ring lowering against torch and against the broadcast lowering, on every rank: equal values
    (element-wise), the same bytes received (it moves the same pieces, point to point), and as many
    batches as the rotation's schedule plans for that rank's grid position, which on a q x q grid with
    even blocks is q - 1 per axis. Uneven sizes (torch.chunk blocks) on 2x3 and 1x4. Catches a piece
    sent to the wrong member, a step that receives twice, and a schedule the planner counts differently."""
    from tests.conftest import get_pool

    R, C_ = grid
    res = get_pool(R * C_).run(C.ring_against_broadcast, grid, *dims)
    assert_every_rank([{f"{k} {lo}": v[lo]["excess"] for k, v in r.items() for lo in ("broadcast", "ring")}
                       for r in res], f"ring lowering on {grid}")
    for rank, r in enumerate(res):
        for kind, v in r.items():
            assert v["ring"]["bytes"] == v["broadcast"]["bytes"] == v["planned bytes"], (rank, kind, v)
            assert v["ring"]["calls"] == v["planned calls"], (rank, kind, v)
            if grid == (2, 2):
                assert v["ring"]["calls"] == 2, (rank, kind, v)  # one batch per axis: q - 1 steps with traffic


def test_grids_share_process_groups(pool4):
    """Catches a Grid that builds new process groups each time (each gloo group keeps threads alive
    until the process ends: a long-lived process that parallelizes many models grew to ~770 threads
    per rank): grids of one shape share their groups and add no thread, and the shared group still
    sums over the right ranks (row r of a 2x2 grid: ranks 2r and 2r+1)."""
    for rank, r in enumerate(pool4.run(C.groups_shared)):
        row = rank // 2
        assert r["new_threads"] == 0 and r["shared"], r
        assert r["sum"] == [float(4 * row + 1)] * 3, r


@pytest.mark.parametrize("lowering", ["broadcast", "ring", "allgather"])
def test_next_panel_travels_during_the_current_matmul(pool4, lowering):
    """Catches a SUMMA lowering that waits for each panel's transfer before posting the next (no double
    buffering), an overlap=False that still overlaps (the in-line baseline the benchmark compares
    with), and an overlap that changes a result or gradient bit, a byte or a launch: with the grid's
    `prefetch` on, AB, ABT and ATB each run a matmul (forward or backward) while the next panel is in
    flight on some rank (in the ring a rank whose next piece is its own receives nothing to wait for),
    and the all-gather lowering's AB has both panels' gathers in flight at once; with it off, no matmul
    on any rank runs with a transfer in flight and the all-gather lowering has one gather in flight at a
    time; both settings agree bit for bit."""
    res = pool4.run(C.prefetch_events, lowering)
    for rank, r in enumerate(res):
        assert all(r["same"].values()), (rank, r["same"])
        for (name, on), flight in r["in flight"].items():
            assert flight, (rank, name, "no matmul seen")
            assert on or not any(flight), f"rank {rank}, {name}, prefetch off: transfers in flight {flight}"
        if lowering == "allgather":
            assert r["most"]["AB", True] == 2 and max(r["most"][n, False] for n in ("AB", "ABT", "ATB")) == 1, \
                (rank, r["most"])
    for name in ("AB", "ABT", "ATB") if lowering != "allgather" else ():
        beside = [rank for rank, r in enumerate(res) if any(r["in flight"][name, True])]
        assert beside, f"{name}: no rank ran a matmul beside a transfer with prefetch on"


@pytest.mark.parametrize("lowering", ["broadcast", "allgather"])
def test_weight_gradient_reduction_overlaps_the_input_gradient(pool4, lowering):
    """Catches a backward that waits for dW's reduction before dX's product starts (no overlap), and an
    overlap that changes a gradient bit, a byte or a launch: with `overlap_grad_reduce` each product's
    dX collectives are launched while dW's reduce (or reduce-scatter) is still in flight, without it
    none are, and both give identical gradients, bytes and launches."""
    for rank, r in enumerate(pool4.run(C.overlap_events, lowering)):
        assert all(r["same"].values()), (rank, r["same"])
        for (name, overlap), n in r["in flight"].items():
            assert (n > 0) == overlap, f"rank {rank}, {name}, overlap={overlap}: {n} launched during dW's reduction"
