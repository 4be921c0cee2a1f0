"""Mixture-of-experts models with their experts split over the grid (passes/rules/moe/experts.py).

Each case runs tests/checks_moe.py on every rank of the shared 4-rank pool: outputs, router logits,
the loss with the load-balancing term, every gradient against one process (tests/compare.py, rtol
1e-4), and the parameters each rank holds.
"""

import pytest

from tests.compare import assert_every_rank
from tests.checks_moe import moe_parity, moe_syncs

HELD = 1.3  # x 1/p: the most of the model's parameters one rank may hold
CASES = {
    ("mixtral", (2, 2)): "top-2 router, fused gate|up experts over the rows and their columns",
    ("mixtral", (1, 4)): "one row: experts whole over it, each expert's intermediate dim over 4 columns",
    ("qwen2_moe", (2, 2)): "shared expert (a plain MLP) next to the routed ones, sigmoid shared gate",
    ("qwen3_moe", (2, 2)): "normalized top-k probabilities",
    ("olmoe", (2, 2)): "q/k norm, unnormalized top-k",
    ("granitemoe", (2, 2)): "GraniteMoe's batched experts",
    ("phimoe", (2, 2)): "sparsemixer router inside a no_grad region",
    ("deepseek_v3", (2, 2)): "grouped sigmoid router, shared expert, dense first layer, 8 experts",
    **{(f, (1, 4)): "one row: each expert's intermediate dim over 4 columns"
       for f in ("qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "deepseek_v3")},
    ("llama4_text", (2, 2)): "experts as a batched matmul over 3-D weights (every token through every expert)",
    ("llama4_text", (1, 4)): "batched-matmul experts: the intermediate dim over 4 columns",
}


def _check(per_rank, what):
    assert_every_rank([r["errs"] for r in per_rank], what)
    names = set(per_rank[0]["errs"])
    assert "output loss" in names and any(n.startswith("grad ") for n in names), names


@pytest.mark.parametrize("family,grid", CASES)
def test_experts_split_parity_and_memory(pool4, family, grid):
    """Catches an expert block multiplied with another block's tokens, gate and up halves that do not
    match on a column, a down projection whose column sums are lost or counted twice, a gradient of a
    routed token missing its other rows' share -- and expert weights left whole on every rank."""
    per_rank = pool4.run(moe_parity, family, grid)
    _check(per_rank, f"{family} {grid} ({CASES[family, grid]})")
    total = per_rank[0]["total"]
    held = max(r["held"] for r in per_rank)
    assert held <= HELD * total / 4, f"{family} {grid}: a rank holds {held} of {total} ({held * 4 / total:.2f}/p)"
    assert not any("grouped_mm" in op for op in per_rank[0]["gathered"]), per_rank[0]["gathered"]
    if grid[0] > 1 and family != "llama4_text":  # more than one row: tokens exchanged by all-to-all
        assert {"ExpertDispatch", "ExpertCombine"} <= set(per_rank[0]["kernels"]), per_rank[0]["kernels"]
    else:  # one row: nothing to exchange; Llama 4 sends every token through every expert (no routing)
        assert "ExpertDispatch" not in per_rank[0]["kernels"], per_rank[0]["kernels"]


def test_experts_without_tokens(pool4):
    """Every token the same: all route to the same two experts, the others get none (an empty run of
    rows on some ranks). Catches offsets read past a block's edge and an empty block that breaks or
    returns garbage instead of zeros."""
    per_rank = pool4.run(moe_parity, "mixtral", (2, 2), same_token=True, num_local_experts=8)
    _check(per_rank, "mixtral 8 experts, one token everywhere")
    assert all(len(layer) <= 2 for layer in per_rank[0]["routed"]), per_rank[0]["routed"]


def test_experts_at_a_second_input_shape(pool4):
    """A call with another batch and sequence length compiles again with the expert weights' blocks
    pinned. Catches a second compile that reads the stored (plain) gate|up blocks as interleaved."""
    per_rank = pool4.run(moe_parity, "mixtral", (2, 2), other_shape=True)
    _check(per_rank, "mixtral 2x2, two input shapes")
    assert any("(batch 2, seq 6)" in n for n in per_rank[0]["errs"]), per_rank[0]["errs"]


def test_expert_count_the_rows_do_not_divide(pool4):
    """5 experts on 2 rows: torch.chunk blocks of 3 and 2. Catches block edges computed as E/R."""
    per_rank = pool4.run(moe_parity, "mixtral", (2, 2), num_local_experts=5)
    _check(per_rank, "mixtral 5 experts at 2x2")


def test_expert_count_kept_whole_is_a_visible_fallback():
    """indivisible='replicate' with 5 experts on 2 rows: the experts stay whole over the rows. Catches
    that happening silently (no fallback record, so no FallbackWarning and no explain line)."""
    import torch

    import autopar
    import hf_families

    torch.manual_seed(0)
    model, make = hf_families.build("mixtral", num_local_experts=5)
    with pytest.warns(autopar.FallbackWarning, match="experts whole over the rows: 5 experts on 2 rows"):
        pl = autopar.plan(model, grid=(2, 2), example_kwargs=make(4, 8, 1), indivisible="replicate",
                          measure_activations=False)
    assert pl.params["model.layers.0.mlp.experts.down_proj"].layout == "RS(2)"
    assert any("experts whole over the rows" in f.reason for f in pl.fallbacks)


def test_batched_experts_kept_whole_is_a_visible_fallback():
    """Llama 4's batched-matmul experts, 5 on 2 rows with indivisible='replicate': they stay whole over
    the rows. Catches that happening silently, and the gate|up weight not split over the columns."""
    import torch

    import autopar
    import hf_families

    torch.manual_seed(0)
    model, make = hf_families.build("llama4_text", num_local_experts=5)
    with pytest.warns(autopar.FallbackWarning, match="experts whole over the rows: 5 experts on 2 rows"):
        pl = autopar.plan(model, grid=(2, 2), example_kwargs=make(4, 8, 1), indivisible="replicate",
                          measure_activations=False)
    assert pl.params["model.layers.0.feed_forward.experts.down_proj"].layout == "RS(1)"
    assert pl.params["model.layers.0.feed_forward.experts.gate_up_proj"].layout == "RS(2)"


def test_mixtral_8x7b_shape_planned_at_8x8():
    """Two layers of the Mixtral-8x7B shape on the meta device at 8x8: every rank holds at most 1.15/p
    of the parameters, the experts over rows and columns. Catches expert weights that a large grid
    leaves whole (an expert or intermediate count the rule misreads) and a plan that no longer builds."""
    import bench_moe_plan

    row = bench_moe_plan.plan_one("mixtral-8x7b", layers=2, experts=None, batch=1, seq=256)
    assert row["params_per_rank_x_1_over_p"] <= 1.15, row
    assert not row["gathered"], row  # the router picks its experts on its own rows (topk rule)


BF16 = 3e-2  # relative norm error of a bf16 tensor: its 8-bit mantissa, summed in another order


def test_bf16_experts_through_torch_grouped_mm(pool4):
    """bf16 weights: transformers calls torch's `_grouped_mm` instead of its fallback op. Catches that
    op left whole (experts replicated), or its runs cut at the wrong rows (errors far above bf16's)."""
    from tests.checks_moe import moe_bf16

    per_rank = pool4.run(moe_bf16, (2, 2))
    # the expert kernels that replaced torch's op (named after its nodes), one per matmul and layer
    assert per_rank[0]["ops"] == [f"autopar_experts__grouped_mm{i}" for i in ("", "_1", "_2", "_3")], per_rank[0]["ops"]
    assert not any("grouped_mm" in op for op in per_rank[0]["gathered"]), per_rank[0]["gathered"]
    for rank, r in enumerate(per_rank):
        bad = {n: e for n, e in r["errs"].items() if not e <= BF16}
        assert not bad, f"rank {rank}: relative errors above {BF16}: {bad}"
        assert r["held"] <= HELD * r["total"] / 4, (r["held"], r["total"])


def test_moe_from_pretrained_on_cpu(pool4, tmp_path):
    """`autopar.from_pretrained` traces on the meta device, where transformers' experts count tokens
    with an integer histc that torch cannot run on CPU tensors. Catches that call failing at the first
    step, and counts of the split histc summed wrongly (outputs, loss, gradients off)."""
    import torch

    import hf_families

    torch.manual_seed(0)
    model, _ = hf_families.build("mixtral")
    model.save_pretrained(tmp_path)
    from tests.checks_moe import moe_from_pretrained

    # the default all-to-all dispatch replaces the routing's histc by its own counts; the gathered one
    # keeps it, split by the histc rule
    _check(pool4.run(moe_from_pretrained, str(tmp_path), (2, 2)), "mixtral from_pretrained at 2x2")
    per_rank = pool4.run(moe_from_pretrained, str(tmp_path), (2, 2), "gather")
    _check(per_rank, "mixtral from_pretrained at 2x2, gathered dispatch")
    assert per_rank[0]["int_histc"] > 0, "the meta-built graph no longer counts tokens with an integer histc"


def test_meta_built_moe_plan_measures_activations():
    """A Mixtral built on the meta device captures transformers' integer histc (its non-CPU branch),
    which torch cannot run on CPU tensors. Catches `plan` (and `inspect`) leaving the activation figure
    empty on it, histc falling back to replication, or the meta-built plan measuring other figures than
    the same model built on the CPU (float histc, split the same way)."""
    import warnings

    import transformers

    import autopar
    import hf_families
    import torch

    cfg = transformers.MixtralConfig(**{**hf_families.TOKENS, **hf_families.FAMILIES["mixtral"].kw})
    with autopar.meta_init():
        meta = transformers.MixtralForCausalLM(cfg)
    torch.manual_seed(0)
    cpu = transformers.MixtralForCausalLM(cfg)
    ids = torch.ones(2, 8, dtype=torch.long)
    plans = []
    for model in (meta, cpu):
        with warnings.catch_warnings():
            # neither "activation memory not measured" nor a fallback warning (only those: a search's
            # progress note, timed, would fire on a loaded machine and fail the run for nothing)
            warnings.simplefilter("error", autopar.PlanWarning)
            warnings.simplefilter("error", autopar.FallbackWarning)
            plans.append(autopar.plan(model, grid=(2, 2), example_kwargs=dict(input_ids=ids, labels=ids)))
    pl, ref = plans
    assert pl.activation_bytes is not None and pl.activation_bytes == ref.activation_bytes, \
        (pl.activation_bytes, ref.activation_bytes)
    assert pl.comm_bytes_per_rank_per_step == ref.comm_bytes_per_rank_per_step
    assert not any("histc" in str(f.node.target) for f in pl.fallbacks), pl.fallbacks
    assert pl.param_bytes_per_rank * 4 <= HELD * pl.param_bytes_total


def test_routed_bytes_are_the_routing_s_exact_figure(pool4):
    """All-to-all dispatch at 2x2: the bytes the routing ops count in a training step equal, on every
    rank, the figure computed from the routing the router chose (pairs each row sends to each row's
    experts). Catches tokens sent to the wrong row, a run gathered whole over the rows, a collective
    left uncounted or counted twice."""
    from tests.checks_moe import moe_routed_bytes

    per_rank = pool4.run(moe_routed_bytes, (2, 2))
    for r in per_rank:
        assert r["counted"] == r["exact"], r
        assert r["exact"]["fwd"] > 0, r


def test_gathered_dispatch_stays_available(pool4):
    """moe_dispatch='gather' at 2x2: the routed tokens gathered over the rows, as before expert
    parallelism; outputs, loss and every gradient still match. Catches the option ignored (the
    all-to-all kernels built anyway) or the gathered path broken by the rewrite's rules."""
    per_rank = pool4.run(moe_parity, "qwen2_moe", (2, 2), dispatch="gather")
    _check(per_rank, "qwen2_moe 2x2, gathered dispatch")
    assert "ExpertDispatch" not in per_rank[0]["kernels"], per_rank[0]["kernels"]


def test_moe_dispatch_option_is_validated():
    """A misspelt dispatch is refused with the values it accepts."""
    from passes.options import Options

    expected = r"moe_dispatch='alltoall': expected one of \('auto', 'all_to_all', 'gather'\)"
    with pytest.raises(ValueError, match=expected):
        Options(moe_dispatch="alltoall")


def test_unrecognised_routing_keeps_the_gathered_dispatch_visibly():
    """Grouped expert matmuls fed by tokens that are not the sorted routed copy (no router, fixed
    offsets): the all-to-all rewrite cannot apply. Catches that layer rewritten anyway (wrong
    results) or left gathered silently (no RoutingWarning naming it)."""
    import torch
    import transformers.integrations.moe  # noqa: F401  (registers transformers' grouped matmul op)

    import autopar
    from passes.transforms.route_experts import RoutingWarning

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = torch.nn.Parameter(torch.randn(4, 8, 16)), torch.nn.Parameter(torch.randn(4, 16, 8))

        def forward(self, x):  # x [16, 8]: 4 rows per expert
            offs = torch.arange(4, 17, 4, dtype=torch.int32)
            h = torch.ops.transformers.grouped_mm_fallback(x, self.w1, offs)
            return torch.ops.transformers.grouped_mm_fallback(torch.relu(h), self.w2, offs)

    kept = r"(?s)1 MoE layer\(s\) keep the gathered token dispatch.*grouped_mm_fallback\): the routed tokens are not an"
    with pytest.warns(RoutingWarning, match=kept):
        autopar.plan(Fixed(), grid=(2, 2), example_inputs=(torch.randn(16, 8),), measure_activations=False)


def test_routing_ops_whole_have_the_gradients_of_what_they_replace():
    """The routing ops run whole where a rule cannot split them (their global meaning, what one process
    computes): gradcheck of the dispatch and the combine, with ties among the expert ids and an expert
    with no pairs. Catches a backward that misses a pair's share or mixes up the sorted order."""
    import torch

    import passes.ops.moe_dispatch  # noqa: F401  (registers the ops)

    ids = torch.tensor([2, 0, 2, 2, 0, 3])  # 3 tokens, top-2; expert 1 gets nothing
    h = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    y = torch.randn(6, 4, dtype=torch.double, requires_grad=True)
    w = torch.rand(6, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: torch.ops.autopar.moe_dispatch(h, ids, 2, 4), (h,))
    assert torch.autograd.gradcheck(lambda y, w: torch.ops.autopar.moe_combine(y, w, ids, 2, 4), (y, w))
    assert torch.ops.autopar.moe_offsets(ids, 4).tolist() == [2, 2, 5, 6]


def test_a_routed_step_reads_the_device_once_per_routing_and_expert_block(pool4):
    """Host syncs of a training step of Mixtral (8 experts over 2 rows): each dispatch and combine reads
    every row's counts per expert once (the all-to-all's split sizes, which the exchange needs on the host),
    each expert block its run's two edges once, backward nothing. Catches routing tables read value by
    value (46 reads per layer before: an `int()` per count and per run of the received rows), and a new
    read in the step. The rest of the step reads nothing with checks='late'; transformers' own fp32
    grouped-matmul fallback reads its offsets once per call, forward and backward (not autopar's)."""
    for rank, r in enumerate(pool4.run(moe_syncs, (2, 2))):
        k = r["kernels"]
        assert k["ExpertDispatch"] == k["ExpertCombine"] == 2 and k["ExpertBlockMM"] == 4, (rank, k)
        assert r["ours"] == k["ExpertDispatch"] + k["ExpertCombine"] + k["ExpertBlockMM"], (rank, r["sites"])
        assert r["total"] - r["ours"] == 2 * k["ExpertBlockMM"], (rank, r["sites"])  # the fallback's offsets
