"""Dims the grid does not divide, split in torch.chunk blocks (indivisible='uneven', the default):
parity with one process on real gloo ranks, and the layouts the split takes."""

import re

import pytest
import torch

import autopar
from tests import checks_engine as C
from tests.compare import RTOL, ATOL_FRAC, assert_every_rank

# prime vocabularies: no grid of 2 or 3 rows/columns divides them
PRIME_VOCAB = dict(vocab_size=97, max_seq=16, hidden=24, heads=6, layers=1)


def _assert_parity(per_rank, what):
    for rank, r in enumerate(per_rank):
        assert r["names match"], f"{what}: rank {rank}: parameter names differ from the original model's"
    assert_every_rank([r["excess"] for r in per_rank], f"{what} (rtol {RTOL}, atol {ATOL_FRAC} x group max)")


# grids of 9 and 6 ranks in this file are ordered so that tests on one world size follow each other
# (conftest keeps a 4-rank pool and one other; each switch between 6 and 9 ranks starts a pool)
@pytest.mark.parametrize("grid,lowering", [((2, 2), "broadcast"), ((2, 2), "allgather"), ((3, 3), "broadcast"),
                                           ((2, 3), "broadcast"), ((3, 2), "allgather"), ((2, 2), "ring"),
                                           ((3, 3), "ring"), ((2, 3), "ring")])
def test_prime_vocabulary_tied_parity(grid, lowering):
    """A vocabulary of 97 on 2 and 3 rows/columns: the tied table is split in torch.chunk blocks over
    the rows, the logits over the columns (blocks of other sizes: 2x3 cuts V at 49 and at 33, 66).
    Catches a lookup or a cross-entropy that places a block at index * local size (wrong for the
    last, shorter block), a SUMMA piece cut at even boundaries, and a loss that counts padding."""
    from tests.conftest import get_pool

    pool = get_pool(grid[0] * grid[1])
    res = pool.run(C.gpt_parity, grid, dict(PRIME_VOCAB, norm="layernorm", mlp="gelu"), lowering, 6, 8, 2)
    _assert_parity(res, f"vocab 97 on {grid} {lowering}")


def test_uneven_features_need_no_fallback(pool4):
    """Linear(16, 7) -> GELU -> Linear(7, 4) on 2x2 by default: the first weight's 7 out-features are
    split (4, 3) over the columns, the second's 7 in-features (4, 3) over the rows and its input's over
    the columns, so SUMMA contracts over unequal pieces; nothing falls back, no warning. Catches a piece
    broadcast with another rank's length and a contraction that counts a padded element."""
    res = pool4.run(C.indivisible_replicate, "uneven")
    for rank, (_, msgs, raised) in enumerate(res):
        assert msgs == [] and raised == "", (rank, msgs, raised)
    assert_every_rank([errs for errs, _, _ in res], "Linear(16, 7) and Linear(7, 4) split in unequal blocks")


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


def test_explain_lists_uneven_splits(pool4):
    """explain names each parameter split in unequal blocks, its blocks and the bytes the largest holds
    above an even share (97 x 24 fp32 on 2x2: 49 x 12 x 4 = 2352 B against 2328), and counts the op
    results split that way, and which grid position receives the most. Catches an uneven split that
    explain hides or prices as even."""
    from tests import checks_uneven as U

    text = pool4.run(U.explain_text)[0]
    assert "uneven splits (torch.chunk blocks, nothing padded): 1 parameter(s)" in text, text
    assert "tok.weight (97, 24) S(0)S(1): dim 0: 49, 48 over 2 rows; largest block 2352 B, 24 B above" in text
    # the table prices grid position (0, 0); the footer names the rank that receives the most
    found = re.search(r"differ by grid position: the table prices \(0, 0\), (\d+) B per step; the most, (\d+) B, "
                      r"at \(([01]), ([01])\)", text)
    assert found and int(found[2]) >= int(found[1]), text


def test_reblocking_moves_only_the_overlaps(pool4):
    """GPT-2 with 3 heads of 8 (hidden 24) at 2x2: q, k and v leave c_attn in hidden blocks (12, 12)
    and attention runs in head blocks (16, 8), so each view moves only the overlap: 4 elements per
    token to one column, nothing to the other, and the output and every backward the reverse. Each
    rank holds 16 tokens (batch 4 over 2 rows, 8 positions), so a move that receives takes
    16 x 4 x 4 B = 256 B. Bytes and calls counted on each rank equal what the plan prices at that
    rank's grid position. Catches a gather left in place, pieces sent to the wrong member, a backward
    that does not move the gradient back, and a plan that prices another rank's share."""
    from tests import checks_uneven as U

    for r in pool4.run(U.planned_and_counted):
        moves = {t: v for t, v in r["modules"].items() if r["kinds"][t] == "ReblockView"}
        assert len(moves) == 4, r["kinds"]  # q, k, v and the output of the one layer
        for tag, v in moves.items():
            assert v["planned"] == v["counted"], (r["at"], tag, v)
            assert v["planned calls"] == v["counted calls"] == (1, 1), (r["at"], tag, v)
        fwd, bwd = (sum(v["counted"][ph] for v in moves.values()) for ph in (0, 1))
        # column 0 receives q, k and v forward and the output's gradient backward; column 1 the reverse
        assert (fwd, bwd) == ((3 * 256, 256) if r["at"][1] == 0 else (256, 3 * 256)), (r["at"], fwd, bwd)


@pytest.mark.parametrize("lowering", ["broadcast", "allgather", "ring"])
def test_planned_bytes_are_each_ranks_own(pool4, lowering):
    """GPT-2 with a vocabulary of 97 and 3 heads at 2x2: for every inserted module (SUMMA products,
    the LM head's over vocabulary blocks of 49 and 48, reblocking views, norms, redistributions), the
    bytes and calls the plan prices at a rank's grid position equal what that rank counts in one
    training step, forward and backward. The LM head's SUMMA receives a different amount on each rank
    (its vocabulary block is 49 or 48 rows), so a plan that prices rank (0, 0)'s blocks everywhere,
    or the all-gather lowering's padding as broadcast pieces, fails here; so does a plan whose rank
    receiving the most is not the rank that counts the most."""
    from tests import checks_uneven as U

    res = pool4.run(U.planned_and_counted, lowering)
    for r in res:
        wrong = {t: v for t, v in r["modules"].items()
                 if v["planned"] != v["counted"] or v["planned calls"] != v["counted calls"]}
        assert wrong == {}, (r["at"], wrong)
    totals = {r["at"]: r["total"] for r in res}
    at, most = res[0]["most"]  # the plan's rank that receives the most, and how much
    assert (most, totals[at]) == (max(totals.values()), most), (res[0]["most"], totals)
    head = [r["modules"]["linear"]["counted"] for r in res]  # the LM head's SUMMA ABT
    if lowering in ("broadcast", "ring"):  # the ranks' shares differ (ring: the broadcast pieces, point to point)
        assert len(set(head)) > 1, head
    else:  # every vocabulary block padded to 49 rows: (49 x 12 + 16 x 49) x 4 B forward, twice backward
        assert head == [(5488, 10976)] * 4, head


@pytest.mark.parametrize("grid,batch,seq", [((2, 2), 3, 7), ((3, 3), 4, 5)])
def test_batch_the_rows_do_not_divide(grid, batch, seq):
    """A batch of 3 on 2 mesh rows (blocks 2, 1) and of 4 on 3 (2, 2 and an empty one), with sequence
    lengths the rows do not divide either: every matmul keeps the batch split over the rows in
    torch.chunk blocks (not whole on every row), the flattened logits are reblocked into token rows,
    and the loss divides by the true token count. Outputs, loss, every gradient and the parameters
    after 2 AdamW steps match one process on every rank. Catches an empty row block reaching a
    reduction (a mean over zero rows, a max of nothing), a loss divided by a per-row count, and a
    weight gradient summed over rows that hold the same rows."""
    from models import GPTConfig, TinyGPT
    from tests.checks_engine import _data
    from tests.conftest import get_pool

    cfg = dict(PRIME_VOCAB, norm="layernorm", mlp="gelu")
    pl = autopar.plan(TinyGPT(GPTConfig(**cfg)), grid=grid, example_inputs=_data(GPTConfig(**cfg), batch, seq),
                      measure_activations=False)
    summa = [r for r in pl.rows if r.op.startswith("SummaLinear")]
    assert summa and all(r.layout == "S(0)S(2)" and "whole" not in r.note for r in summa), \
        [(r.node, r.layout, r.note) for r in summa]
    res = get_pool(grid[0] * grid[1]).run(C.gpt_parity, grid, cfg, "broadcast", batch, seq, 2)
    _assert_parity(res, f"batch {batch} x {seq} on {grid}")


# hidden 27 (2x2: 14 + 13 per column and row; 2x3: 9 per column, 14 + 13 per row), 3 heads of 9
ODD_HIDDEN = dict(vocab_size=101, max_seq=16, hidden=27, heads=3, layers=1)


@pytest.mark.parametrize("grid,norm,mlp", [((3, 3), "layernorm", "gelu"), ((2, 2), "layernorm", "gelu"),
                                           ((2, 3), "rmsnorm", "swiglu")])
def test_hidden_size_the_grid_does_not_divide(grid, norm, mlp):
    """A hidden size of 27 and a vocabulary of 101: every weight's in-features are torch.chunk blocks,
    so SUMMA contracts over unequal pieces (2x3: x cut 9/9/9 over columns, W 14/13 over rows, four
    pieces of 9, 5, 4, 9), norms sum statistics over unequal blocks and divide by 27. Catches a piece
    broadcast with the wrong length, a norm dividing by the local size, a mean over a padded block."""
    from tests.conftest import get_pool

    pool = get_pool(grid[0] * grid[1])
    cfg = dict(ODD_HIDDEN, norm=norm, mlp=mlp)
    _assert_parity(pool.run(C.gpt_parity, grid, cfg, "broadcast", 6, 8, 2), f"hidden 27, vocab 101 on {grid}")


@pytest.mark.parametrize("norm,mlp", [("layernorm", "gelu"), ("rmsnorm", "swiglu")])
def test_1d_strategy_with_sizes_the_columns_do_not_divide(pool4, norm, mlp):
    """strategy='1d' on 1x4 with a vocabulary of 101, a hidden size of 27 (blocks 7, 7, 7, 6) and 3
    heads (1, 1, 1 and none): every weight split over the columns in torch.chunk blocks, none
    replicated and no op falling back, and one process's outputs, loss, gradients and parameters
    after 2 AdamW steps. Catches a 1D column or row split still refused for such sizes (the weight
    then whole on every rank) and a partial sum over unequal in-feature blocks."""
    from models import GPTConfig, TinyGPT
    from tests.checks_engine import _data

    cfg = dict(ODD_HIDDEN, norm=norm, mlp=mlp)
    pl = autopar.plan(TinyGPT(GPTConfig(**cfg)), grid=(1, 4), example_inputs=_data(GPTConfig(**cfg), 4, 8),
                      strategy="1d", measure_activations=False)
    whole = [n for n, p in pl.params.items() if len(p.shape) == 2 and p.layout == "RR"]
    assert pl.fallbacks == [] and whole == [], (pl.fallbacks, whole)
    res = pool4.run(C.gpt_parity, (1, 4), cfg, "broadcast", 4, 8, 2, strategy="1d")
    _assert_parity(res, f"1d, hidden 27, vocab 101, {norm} {mlp}")


@pytest.mark.parametrize("family,over,grid", [
    ("gpt2", dict(vocab_size=97, n_embd=24, n_head=3), (2, 2)),  # tied LM head, fused c_attn, 3 heads
    ("llama", dict(vocab_size=97), (2, 2)),  # untied LM head, RMSNorm, 2 KV heads
    ("gpt2", dict(vocab_size=101, n_embd=27, n_head=3), (2, 3)),  # hidden 27 too
])
def test_transformers_models_with_odd_sizes(family, over, grid):
    """transformers' own models with a prime vocabulary (and GPT-2 with 3 heads or a hidden size of 27):
    logits, loss and every gradient at two input shapes, no warning, and every weight split (none held
    whole). Catches HF's loss path (logits.float(), view(-1, V), shifted labels, sum or mean) meeting a
    vocabulary in unequal blocks, and an untied LM head's out-features left whole."""
    from tests import checks_hf as H
    from tests.conftest import get_pool

    res = get_pool(grid[0] * grid[1]).run(H.hf_parity, family, over, 4, 8, (2, 6), None, grid)
    assert_every_rank([r["excess"] for r in res], f"{family} {over} on {grid}")
    assert res[0]["warned"] == [], res[0]["warned"]
    p = grid[0] * grid[1]
    held = res[0]["fraction"] / 4  # rank 0's share of the parameters (it holds the largest blocks)
    assert held <= 1.3 / p, f"rank 0 holds {held * p:.2f}/p of the parameters"


@pytest.mark.parametrize("over,grid", [
    (dict(hidden_size=40, num_attention_heads=10, num_key_value_heads=5), (2, 2)),  # 5 KV heads on 2 columns
    (dict(num_key_value_heads=2), (1, 4)),  # fewer KV heads (2) than columns (4)
])
def test_kv_heads_the_columns_do_not_divide(over, grid):
    """Llama with grouped KV heads the columns do not divide: query heads split over the columns, each
    column picking the KV heads its query heads read (2x2 with 10 and 5 heads: column 0 reads KV heads
    0-2, column 1 reads 2-4). Catches a column reading its neighbour's KV head, and KV gradients not
    summed over the columns that share a KV head."""
    from tests import checks_rules as CR
    from tests.conftest import get_pool

    res = get_pool(grid[0] * grid[1]).run(CR.hf_parity, "llama", grid, True, over)  # SDPA with enable_gqa
    assert_every_rank([r["excess"] for r in res], f"llama {over} on {grid}")
    assert res[0]["warned"] == [], res[0]["warned"]
    assert "GroupedHeadsAttention(heads=" in res[0]["explain"], res[0]["explain"]


class _OddHeads(torch.nn.Module):
    """10 query heads and 5 KV heads of 3 (hidden 30), read with enable_gqa, then a residual add."""

    def __init__(self, kv: int):
        super().__init__()
        self.kv = kv
        self.q = torch.nn.Linear(30, 30)
        self.k = torch.nn.Linear(30, 3 * kv)
        self.v = torch.nn.Linear(30, 3 * kv)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 10, 3).transpose(1, 2)  # [b, 10, s, 3]
        k = self.k(x).view(b, s, self.kv, 3).transpose(1, 2)  # [b, kv, s, 3]
        v = self.v(x).view(b, s, self.kv, 3).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != 10)
        return y.transpose(1, 2).reshape(b, s, 30) * 2 + x  # [b, s, 30]


@pytest.mark.parametrize("q", [2, 3, (2, 3), (3, 4)])
@pytest.mark.parametrize("kv", [10, 5])
def test_odd_heads_against_the_oracle(q, kv):
    """Each rank's blocks (torch.chunk blocks of 10 heads over 3 or 4 columns: 4, 4, 2 / 3, 3, 3, 1)
    run through the rules' layouts and reassembled must equal the whole op: views that keep an uneven
    dim, attention on head blocks, KV heads picked per column (5 KV heads). Catches a column reading
    another column's KV head and a view baked with another rank's block size."""
    from tests.test_rules_oracle import check_local_rules

    x = torch.randn(3, 4, 30, generator=torch.Generator().manual_seed(0))
    check_local_rules(_OddHeads(kv), (x,), q, expect=(torch.ops.aten.scaled_dot_product_attention,))
