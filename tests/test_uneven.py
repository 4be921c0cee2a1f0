"""Dims the grid does not divide, split in torch.chunk blocks (indivisible='uneven', the default):
parity with one process on real gloo ranks, and the layouts the split takes."""

import pytest

from tests import checks_engine as C
from tests.compare import RTOL, ATOL_FRAC, assert_every_rank

# prime vocabularies: no grid of 2 or 3 rows/columns divides them
PRIME_VOCAB = dict(vocab_size=97, max_seq=16, hidden=24, heads=6, layers=2)


def _assert_parity(per_rank, what):
    for rank, r in enumerate(per_rank):
        assert r["names match"], f"{what}: rank {rank}: parameter names differ from the original model's"
    assert_every_rank([r["excess"] for r in per_rank], f"{what} (rtol {RTOL}, atol {ATOL_FRAC} x group max)")


@pytest.mark.parametrize("grid,lowering", [((2, 2), "broadcast"), ((2, 2), "allgather"), ((2, 3), "broadcast"),
                                           ((3, 2), "allgather"), ((3, 3), "broadcast")])
def test_prime_vocabulary_tied_parity(grid, lowering):
    """A vocabulary of 97 on 2 and 3 rows/columns: the tied table is split in torch.chunk blocks over
    the rows, the logits over the columns (blocks of other sizes: 2x3 cuts V at 49 and at 33, 66).
    Catches a lookup or a cross-entropy that places a block at index * local size (wrong for the
    last, shorter block), a SUMMA piece cut at even boundaries, and a loss that counts padding."""
    from tests.conftest import get_pool

    pool = get_pool(grid[0] * grid[1])
    res = pool.run(C.gpt_parity, grid, dict(PRIME_VOCAB, norm="layernorm", mlp="gelu"), lowering, 6, 8, 2)
    _assert_parity(res, f"vocab 97 on {grid} {lowering}")


def test_uneven_out_features_then_fallback(pool4):
    """Linear(16, 7) -> GELU -> Linear(7, 4) on 2x2 by default: the first weight's 7 out-features are
    split (4, 3), the second's 7 in-features cannot be (a contraction over unequal blocks) and it runs
    unsplit, its input gathered from blocks of 4 and 3 rows. Catches a gather that assumes equal blocks
    (8 values, one of them padding) and a fallback warning that names the wrong op."""
    res = pool4.run(C.indivisible_replicate, "uneven")
    _, msgs, _ = res[0]
    assert len(msgs) == 1 and "1 op(s) run unsplit" in msgs[0] and "linear_1 (aten.linear.default)" in msgs[0], msgs
    assert_every_rank([errs for errs, _, _ in res], "Linear(16, 7) split (4, 3), Linear(7, 4) unsplit")


@pytest.mark.parametrize("grid", [(2, 2), (2, 3)])
def test_three_heads_parity(grid):
    """3 attention heads (hidden 24 still divisible) on 2 and 3 columns: attention runs on torch.chunk
    blocks of heads (2 and 1 on two columns), its output gathered back from unequal blocks. Catches a
    head split that cuts a head in two, a gather that keeps padding, a k/v split unlike q's."""
    from tests.conftest import get_pool

    pool = get_pool(grid[0] * grid[1])
    cfg = dict(PRIME_VOCAB, heads=3, norm="rmsnorm", mlp="swiglu")
    _assert_parity(pool.run(C.gpt_parity, grid, cfg, "broadcast", 6, 8, 2), f"3 heads, vocab 97 on {grid}")


def test_checkpoints_keep_true_shapes_across_grids(pool4, tmp_path):
    """GPT-2 with a vocabulary of 97 and 3 heads: state_dict shows (97, 24), not a padded size; a DCP
    checkpoint saved at 2x2 (vocab rows 49 + 48) loads at 1x4 (logit columns 25, 25, 25, 22) and a
    save_pretrained one at 4x1 (rows 25, 25, 25, 22), parameters and Adam states bit-equal. Catches a
    block placed at index x local size, and any padding written to a file."""
    from tests import checks_uneven as U
    from tests.compare import failures

    res = pool4.run(U.checkpoints_across_grids, str(tmp_path))
    assert failures([r["errs"] for r in res]) == {}
    for rank, r in enumerate(res):
        # a tied weight is saved under its first name, as before (lm_head.weight is transformer.wte.weight)
        assert r["shapes"] == {k: r["true shapes"][k] for k in r["shapes"]}, rank
        assert r["shapes"]["transformer.wte.weight"] == (97, 24)
    assert [r["wte block"] for r in res] == [(49, 12), (49, 12), (48, 12), (48, 12)]
