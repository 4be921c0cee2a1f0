"""Transposes by alias (.T, .mT, .mH, swapaxes, movedim), attention with fewer KV heads than query heads,
and advanced indexing: the rules against the one-process oracle (tests/test_rules_oracle.py), then
forward and backward on gloo grids against the unmodified model, element-wise on every rank.

The models these rules were written for: Falcon's multi-query decoder (a fused query_key_value with
one KV head, every weight used as `x @ w.T`, the key and value heads picked by `fused[..., [-2], :]`)
held 3.73/p of its parameters per rank at 2x2 before, every weight whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.export import capture
from passes.meta import LAYOUT
from passes.transforms.propagate import propagate
from tests import checks_rules as C
from tests.compare import assert_every_rank
from tests.test_rules_oracle import QS, check_local_rules

aten = torch.ops.aten
B, S_, H = 6, 6, 12
NH = 6  # query heads, head_dim 2


class WeightAliases(nn.Module):
    """Weights used through every transpose alias export keeps: each must be placed by its matmul."""

    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(H, H)) for _ in range(6)])
        self.w3 = nn.Parameter(torch.randn(2, H, H))

    def forward(self, x):
        w = self.ws
        h = x @ w[0].T + x @ w[1].mT + x @ w[2].mH
        h = h + x @ w[3].swapaxes(0, 1) + x @ w[4].movedim(0, 1) + x @ w[5].adjoint()
        return h, h @ self.w3.mT.sum(0) + x.movedim(-1, 0).sum(0, keepdim=True).movedim(0, -1)


@pytest.mark.parametrize("q", QS)
def test_weight_through_transpose_aliases(q):
    """Catches a weight behind `.T`/`.mT`/`.mH`/`swapaxes`/`movedim`/`adjoint` kept whole (the ops
    had no rule: Falcon's every weight stayed replicated) or placed with its dims swapped wrongly."""
    module = WeightAliases()
    check_local_rules(module, (torch.randn(B, S_, H),), q,
                      expect=(aten.numpy_T, aten.mT, aten.mH, aten.swapaxes, aten.movedim, aten.adjoint))
    cap = capture(module.eval(), (torch.randn(B, S_, H),))
    layouts = propagate(cap.gm, mesh=q).param_layouts
    whole = [n for n, lay in layouts.items() if n.startswith("ws.") and lay.is_replicated]
    assert not whole, f"weights kept whole behind a transpose alias: {whole}"


class Grouped(nn.Module):
    def __init__(self, kv: int, gqa: bool, mask: bool):
        super().__init__()
        self.kv, self.gqa, self.mask = kv, gqa, mask
        self.q = nn.Linear(H, H)
        self.k = nn.Linear(H, kv * H // NH)
        self.v = nn.Linear(H, kv * H // NH)

    def forward(self, x, m=None):
        b, s, _ = x.shape

        def heads(t, n):
            return t.view(b, s, n, H // NH).transpose(1, 2)  # [b, n, s, d]

        q, k, v = heads(self.q(x), NH), heads(self.k(x), self.kv), heads(self.v(x), self.kv)
        if self.mask:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=self.gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("kv,gqa,mask", [(1, False, False), (1, True, False), (2, True, False),
                                         (3, True, False), (3, True, True), (6, True, False)])
def test_sdpa_fewer_kv_heads(q, kv, gqa, mask):
    """6 query heads on 1 KV head (broadcast and enable_gqa), 2 and 3 (grouped) and 6; grids of 1, 2
    and 3 columns, so the KV heads are split with their query groups (3 KV heads on 3 columns), kept
    whole (1 KV head) or leave the heads whole (2 KV heads on 3 columns). Catches a column reading
    another column's KV heads, a local group size that differs from the global one, and a mask whose
    head dim is cut while the scores' is not."""
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(B, S_, H, generator=g),)
    if mask:
        m = torch.rand(B, NH, S_, S_, generator=g) > 0.3
        m[..., torch.arange(S_), torch.arange(S_)] = True
        args = (*args, m)
    names = check_local_rules(Grouped(kv, gqa, mask), args, q, expect=(aten.scaled_dot_product_attention,))
    assert names


def test_sdpa_kv_layouts():
    """The layouts themselves (the oracle accepts a replicated answer): batch over the rows, query heads
    over the columns; KV heads split with them when the columns divide them, else whole."""
    from passes.rules.attention import kv_layout

    def lay(s):
        return str(s[0]) + "|" + str(s[1])

    assert lay(kv_layout((4, 4, 8, 8), (4, 1, 8, 8), False, (2, 2))) == "S(0)S(1)|S(0)R"
    assert lay(kv_layout((4, 4, 8, 8), (4, 2, 8, 8), True, (2, 2))) == "S(0)S(1)|S(0)S(1)"
    # a 1-row axis: every rank holds all
    assert lay(kv_layout((4, 6, 8, 8), (4, 2, 8, 8), True, (1, 3))) == "S(0)R|S(0)R"
    assert lay(kv_layout((4, 6, 8, 8), (4, 3, 8, 8), True, (1, 3))) == "S(0)S(1)|S(0)S(1)"


class Indexing(nn.Module):
    """Advanced indexing on split activations: a head picked from a head-split view (Falcon), positions
    gathered per sequence (`h[arange, pos]`), rows chosen along the batch, two index tensors separated
    by a slice (the result's dims then come first), a table parameter indexed by a buffer (Swin's
    relative position bias)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.table = nn.Parameter(torch.randn(5, H))
        self.register_buffer("where", torch.tensor([[0, 4, 1], [2, 2, 3]]))

    def forward(self, x, pos, rows):
        b, s, _ = x.shape
        h = self.lin(x)  # [b, s, h] S(0)S(2)
        heads = h.view(b, s, NH, H // NH)
        picked = heads[:, :, [-2]] * 2 + heads[:, :, torch.tensor([1, 3])].sum(2, keepdim=True)
        last = h[torch.arange(b), pos]  # [b, h]
        chosen = h[rows]  # [len(rows), s, h]
        apart = h[rows[:2], :, pos[:2]]  # [2, s]
        bias = self.table[self.where]  # [2, 3, h]
        return picked, last, chosen, apart, h[:, :2, None] + bias.sum((0, 1))


@pytest.mark.parametrize("q", QS)
def test_index_tensor(q):
    """Catches an indexed dim kept split (each rank would pick from its block only), a split kept dim
    moved to the wrong output dim (adjacent index tensors: in place; separated ones: after the
    broadcast dims), and an index tensor cut like the data."""
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(B, S_, H, generator=g), torch.randint(0, S_, (B,), generator=g),
            torch.tensor([5, 0, 3, 3]))
    check_local_rules(Indexing(), args, q, expect=(aten.index.Tensor,))


def test_index_rule_keeps_unindexed_splits():
    """x[:, :, [k]] on a head-split view keeps the batch split and gathers only the heads; the
    parameter indexed by a buffer is stored whole (a small table)."""
    cap = capture(Indexing().eval(), (torch.randn(B, S_, H), torch.randint(0, S_, (B,)), torch.tensor([1])))
    res = propagate(cap.gm, mesh=2)
    first = next(n for n in cap.gm.graph.nodes if n.target == aten.index.Tensor)
    assert str(first.args[0].meta[LAYOUT]) == "S(0)S(2)" and str(first.meta[LAYOUT]) == "S(0)R"
    assert res.param_layouts["table"].is_replicated
    assert not res.fallbacks, res.fallbacks


# ----------------------------------------------------------------------- forward and backward on gloo


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
@pytest.mark.parametrize("kv", [1, 2, 3])
def test_multi_query_module_parity(pool4, grid, kv):
    """MultiQuery (tests/checks_rules.py) forward and backward on every rank: both outputs and every
    gradient against one process. kv=1: K/V whole over the columns, their gradient summed over them;
    kv=2: split with the query groups at 2 columns (not at 4: heads whole); kv=3: never divisible."""
    res = pool4.run(C.module_parity, kv, grid)
    assert_every_rank([r["excess"] for r in res], f"multi-query kv={kv} {grid}")
    for rank, r in enumerate(res):
        assert not r["gathered"], f"rank {rank}: gathered whole: {r['gathered']}"
        assert "Replicate()Replicate()" not in r["layouts"].values(), (rank, r["layouts"])


def _hf(pool4, family, grid, force_gqa=False):
    res = pool4.run(C.hf_parity, family, grid, force_gqa)
    what = f"{family} {grid[0]}x{grid[1]}" + (" enable_gqa" if force_gqa else "")
    assert_every_rank([r["excess"] for r in res], what)
    for rank, r in enumerate(res):
        assert not r["warned"], f"{what}: rank {rank}: ops gathered whole: {r['warned']}"
        assert not r["unsplit_2d"], f"{what}: rank {rank}: 2-D weights kept whole: {r['unsplit_2d']}"
    print(f"{what}: parameters per rank {max(r['fraction'] for r in res):.3f}/p")
    return res


# Falcon at hidden 32, 2 layers, 4 query heads of 8 and one KV head, vocabulary 64, tied head: 2-D
# weights word_embeddings 64x32 and per layer query_key_value (4 + 2) * 8 x 32, dense 32x32,
# dense_h_to_4h 128x32, dense_4h_to_h 32x128: 2048 + 2 * 10752 = 23552 elements; 1-D LayerNorm weights
# and biases (2 per layer, ln_f): 6 x 32 = 192. All 23744 elements, 94976 bytes (fp32).
# 2x2: a 2-D weight is split S(1)S(0) into 4 blocks; a norm vector is RS(0): half of it on each rank.
FALCON_BYTES = {(2, 2): 4 * (23552 // 4 + 192 // 2), (1, 4): 4 * (23552 // 4 + 192 // 4)}  # 23936, 23744


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
def test_falcon_multi_query_parity_and_bytes(pool4, grid):
    """Falcon's multi-query decoder (every weight used as `x @ w.T`, K/V heads picked by indexing, one
    KV head broadcast in SDPA): logits, loss and every gradient on every rank, nothing gathered whole,
    and exactly the parameter bytes its layouts give (it held 3.73/p at 2x2 before these rules)."""
    res = _hf(pool4, "falcon", grid)
    assert FALCON_BYTES[(2, 2)] == 23936 and FALCON_BYTES[(1, 4)] == 23744
    for rank, r in enumerate(res):
        assert r["full_bytes"] == 94976, r["full_bytes"]
        assert r["held_bytes"] == FALCON_BYTES[grid], (rank, r["held_bytes"], FALCON_BYTES[grid])


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
@pytest.mark.parametrize("family,force_gqa", [("gpt_bigcode", False), ("llama", True), ("mistral", True)])
def test_fewer_kv_heads_parity(pool4, grid, family, force_gqa):
    """GPTBigCode's multi-query c_attn; Llama (2 KV heads for 4 query heads) and Mistral (1 KV head)
    with transformers' SDPA path forced to pass the KV heads as they are with enable_gqa=True (what it
    does on CUDA without a mask): 2 KV heads split with their query groups over 2 columns, left whole
    over 4. Logits, loss and every gradient on every rank; parameters at most 1.1/p per rank."""
    for r in _hf(pool4, family, grid, force_gqa):
        assert r["fraction"] <= 1.1, r["fraction"]


class CacheWrite(nn.Module):
    """A KV cache write: keys of the new tokens copied into a [B, heads, L, head_dim] tensor at their
    slots, both split batch over rows and heads over columns by the projections that make them."""

    def __init__(self):
        super().__init__()
        self.old = nn.Linear(H, H, bias=False)
        self.new = nn.Linear(H, H, bias=False)

    def forward(self, x, y, slots):
        cache = self.old(x).view(B, S_, NH, H // NH).transpose(1, 2)  # [B, NH, L, hd]
        keys = self.new(y).view(B, 2, NH, H // NH).transpose(1, 2)  # [B, NH, 2, hd]
        return cache.index_copy(2, slots, keys) * 2


@pytest.mark.parametrize("q", QS)
def test_index_copy_cache_write(q):
    """Catches the cache-write rule writing a block into the wrong rank's slots or asking the slot
    dim to be split (pmodel.generate's static cache is written this way, in place)."""
    args = (torch.randn(B, S_, H), torch.randn(B, 2, H), torch.tensor([1, 4]))
    check_local_rules(CacheWrite(), args, q, expect=(aten.index_copy,))
