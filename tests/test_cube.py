"""3D tensor parallelism's linear on a 2x2x2 cube of 8 gloo ranks (`passes.ops.cube`)."""

import pytest

from tests import checks_cube as C
from tests.compare import assert_every_rank


@pytest.mark.parametrize("lowering", ["broadcast", "ring", "allgather"])
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
    columns do not divide, raise a UsageError naming the sizes, on every rank alike; so do
    strategy='3d' on a grid that is not a cube, on a cube with pipeline stages and on one with
    data_parallel='shard' (dropped without a word before: issue 50, item 6), and a device count
    (grid=p) that is not the world size, with a fixed strategy or with stages."""
    from tests.conftest import get_pool

    for rank, r in enumerate(get_pool(8).run(C.refusals)):
        for name in ("grid 2x4", "grid 2x2x1", "pipeline", "shard"):
            kind, msg = r[name]
            assert kind == "UsageError" and "grid=(q, q, q)" in msg, (rank, name, msg)
        assert "and data_parallel='shard'" in r["shard"][1], r["shard"]
        assert r["count 4"][0] == "UsageError" and "grid=4 but the process group has 8 ranks" in r["count 4"][1], r
        assert r["count 2d"][0] == "UsageError" and "needs strategy='auto' (got '2d')" in r["count 2d"][1], r
        assert r["count pipeline"][0] == "UsageError" and "with pipeline stages" in r["count pipeline"][1], r
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


CASES = {  # family -> (config overrides, linears that run 2D on the 2x4 grid)
    "llama": (None, 0),  # untied LM head: every linear 3D; HF's own loss from labels
    "tinygpt": (dict(vocab_size=64, max_seq=16, hidden=32, heads=4, layers=1, norm="rmsnorm", mlp="swiglu"), 1),
    "gpt2": (None, 1),  # Conv1D weights stored [K, N], fused c_attn
    "gpt2-uneven": (dict(vocab_size=97, n_head=3, n_embd=24), 1),  # 3 heads of 8 on 4 columns, vocabulary 97
}


@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_one_process_on_a_cube(case):
    """strategy='3d' on grid=(2, 2, 2): the model against itself on one process, on every rank:
    logits, loss and every gradient after one step, every parameter after 3 AdamW steps (fp32,
    tests/compare.py's rtol, atol scaled per group). Each 3D linear's weight is held 1/8 per rank in a
    cube layout; on every rank each linear's counted bytes, and the step's total, equal what the plan
    prices at that rank's grid position (with 3 heads on 4 columns too, where a split's backward
    all-gather pads the empty block). A tied LM head (the embedding placed its table first) runs 2D
    SUMMA on the 2x4 grid, and a PlanWarning names it.
    Catches a weight placed in the wrong cube block, a partial sum not reduced over the depth, a
    gradient left unreduced over a cube axis, and a plan that prices another layout than runs."""
    from tests.conftest import get_pool

    family = case.split("-")[0]
    over, two_d = CASES[case]
    res = get_pool(8).run(C.model_steps, family, over)
    assert_every_rank([r["excess"] for r in res], f"{case} on a 2x2x2 cube")
    for rank, r in enumerate(res):
        assert r["names match"], rank
        kinds = [op for op, _, _ in r["linears"].values()]
        assert kinds.count("SummaLinear") == two_d and kinds.count("CubeLinear") >= 4, (rank, r["linears"])
        assert all(counted == planned for _, counted, planned in r["linears"].values()), (rank, r["linears"])
        assert r["totals"][0] == r["totals"][1], (rank, r["totals"])
        for name, (local, whole, placed) in r["held"].items():
            if placed == 3:  # a cube weight: 1/q^3 of it
                assert local * 8 == whole, (rank, name, local, whole)
        if rank == 0:  # warnings show on rank 0 only (passes.mesh.warn)
            assert (len(r["warned"]) == 1 and "run 2D SUMMA on the 2x4 grid" in r["warned"][0]) == (two_d > 0), \
                r["warned"]


COMPOSE = {  # case -> (family, config overrides, parallelize keywords)
    "mixtral": ("mixtral", None, {}),  # experts routed per token (all-to-all over the rows), a router loss
    "recompute=blocks": ("llama", dict(num_hidden_layers=2), dict(recompute="blocks")),
    "compile=True": ("llama", None, dict(compile=True)),  # the depth collectives as autopar:: library ops
}


@pytest.mark.parametrize("case", list(COMPOSE))
def test_the_cube_composes(case):
    """strategy='3d' with what else a model brings: Mixtral's routed experts (the 2D MoE rules on the
    cube's 2x4 grid beside 3D attention projections, the router's load-balancing loss), recomputed
    blocks (each block's forward, its 3D linears' depth collectives included, run again in backward)
    and compile=True (one graph, no break: the depth collectives are autopar:: library ops):
    against one process on every rank, as above (logits, loss, every gradient after one step, every
    parameter after 3 AdamW steps), and each rank's bytes equal its plan's."""
    from tests.conftest import get_pool

    family, over, options = COMPOSE[case]
    res = get_pool(8).run(C.model_steps, family, over, options=options)
    assert_every_rank([r["excess"] for r in res], f"{case} on a 2x2x2 cube")
    for rank, r in enumerate(res):
        kinds = [op for op, _, _ in r["linears"].values()]
        assert kinds.count("CubeLinear") >= 4, (rank, r["linears"])
        assert all(counted == planned for _, counted, planned in r["linears"].values()), (rank, r["linears"])
        assert r["totals"][0] == r["totals"][1], (rank, r["totals"])
        assert r["compiled"] == ((1, 0) if options.get("compile") else ()), (rank, r["compiled"])


MIX = {"q_proj|model.layers.*.self_attn.k_proj|model.layers.*.self_attn.v_proj": "3d", "o_proj": "1d",
       "gate_proj|model.layers.*.mlp.up_proj": "rep", "down_proj": "3d", "lm_head": "2d", "embed_tokens": "1d"}


def test_a_searched_mix_on_the_cube_matches_one_process():
    """parallelize(grid=8, strategy='auto') where the arrangement search answers the cube with a
    per-unit mix (q|k|v and down_proj 3D, o_proj 1D, gate|up replicated, the LM head 2D SUMMA on the
    2x4 grid, the embedding 1D): HF Llama against one process on every rank, as above (logits, loss,
    every gradient, parameters after 2 AdamW steps); the ranks build the cube; the 3D linears hold
    1/8 of their weights and move what the plan prices. Catches a layout change between a 3D linear
    and its 1D or replicated neighbour that is not redistributed, and a cube not built for a searched
    arrangement."""
    from tests.conftest import get_pool

    res = get_pool(8).run(C.model_steps, "llama", None, 2, mix=MIX)
    assert_every_rank([r["excess"] for r in res], "a searched mix on a 2x2x2 cube")
    for rank, r in enumerate(res):
        assert r["grid"] == ((2, 4), True), (rank, r["grid"])
        kinds = [op for op, _, _ in r["linears"].values()]
        assert kinds.count("CubeLinear") == 4 and kinds.count("SummaLinear") == 1, (rank, r["linears"])
        assert all(counted == planned for _, counted, planned in r["linears"].values()), (rank, r["linears"])
        assert r["totals"][0] == r["totals"][1], (rank, r["totals"])
        assert r["warned"] == [], (rank, r["warned"])


def test_the_search_arranges_the_ranks_and_matches_one_process():
    """parallelize(grid=8, strategy='auto') with the search as it is: rank 0 arranges the 8 ranks, every
    rank builds the grid `autopar.choose_grid` (without replicas) picks for the same model and inputs on
    this process, `autopar.explain` shows every candidate's row with that one chosen, and HF Llama trains
    as on one process, on every rank: logits, loss, every gradient
    and every parameter after one AdamW step; each rank's bytes equal its plan's."""
    import autopar
    from tests.checks_hf import build
    from tests.conftest import get_pool

    model, make = build("llama")
    gc = autopar.choose_grid(model, 8, (), make(4, 8, 1), replica_layouts=False)
    res = get_pool(8).run(C.model_steps, "llama", None, 1, mix="search")
    assert_every_rank([r["excess"] for r in res], "the searched arrangement of 8 ranks")
    mesh = (2, 4) if gc.layout == "3d" else gc.grid
    assert all(r["grid"] == (mesh, gc.layout == "3d") for r in res), ([r["grid"] for r in res], gc.grid)
    assert all(r["totals"][0] == r["totals"][1] for r in res), [r["totals"] for r in res]
    from autopar.planning.grids import describe

    for rank, r in enumerate(res):  # explain shows the search's table, without a second search (issue 50, item 8)
        at = r["explain"].index("arrangement (grid=p: every candidate the search priced for these devices):")
        chosen = [line for line in r["explain"][at:] if line.endswith("<- chosen")]
        assert len(chosen) == 1 and chosen[0].strip().startswith(describe(gc.layout, gc.grid) + ":"), (rank, chosen)
        assert len([ln for ln in r["explain"][at + 1:] if ln.startswith("  ")]) >= len(gc.table), (rank, r["explain"])


def test_cube_linear_bytes_are_the_formula_in_a_model():
    """The repo's GPT at 2x2x2: its MLP's up projection (x [32 tokens, 32] . W [32, 128], both gradients)
    receives e(q-1)(MK + KN + MN)/q^3 forward and e(q-1)(2MK + 2KN + MN)/q^3 backward, 11776 bytes,
    on every rank (the formula, not the plan: `passes.cost.cube`). Bytes only: a dry run of all 8 ranks
    in this process (`autopar.dry_run`), not 8 processes."""
    import warnings

    import torch

    import autopar
    from models import GPTConfig, TinyGPT
    from passes.cost.cube import cube_linear_bytes

    over, _ = CASES["tinygpt"]
    want = sum(cube_linear_bytes(32, 32, 128, 2, 4))
    torch.manual_seed(0)
    ids = torch.randint(0, over["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = autopar.dry_run(TinyGPT(GPTConfig(**over)), grid=(2, 2, 2), strategy="3d", ranks=range(8),
                                 example_kwargs=dict(ids=ids, targets=ids))
    assert sorted(report.ranks) == list(range(8))
    for rank, run in report.ranks.items():
        ups = [tag for tag, n in run.tags.items() if n == want]
        assert len(ups) == 2, (rank, want, run.tags)  # up and gate: the same shape


def test_cube_checkpoints_round_trip(tmp_path):
    """A Llama on 2x2x2 after one AdamW step: torch.distributed.checkpoint (model and optimizer) read
    back by a cube model and by a 2x4 grid; save_pretrained read back by autopar.from_pretrained on the
    cube; every parameter and AdamW state bit-equal, on every rank."""
    from tests.conftest import get_pool

    res = get_pool(8).run(C.checkpoints, str(tmp_path))
    for rank, r in enumerate(res):
        bad = {k: v for k, v in r.items() if v > 0}
        assert bad == {} and len(r) > 40, (rank, bad)


def test_plan_refuses_a_cube_with_sharded_replicas():
    """Catches autopar.plan dropping data_parallel='shard' with strategy='3d' (issue 50, item 6: it returned
    a cube plan without replicas, without a word); parallelize refuses the same call
    (test_blocks_that_do_not_fit_are_refused)."""
    import torch

    import autopar

    model, x = torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.randn(4, 16)
    with pytest.raises(autopar.UsageError, match=r"autopar.plan: strategy='3d' with grid=\(2, 2, 2\) and "
                                                 r"data_parallel='shard'.*strategy='2d'"):
        autopar.plan(model, grid=(2, 2, 2), example_inputs=(x,), strategy="3d", data_parallel="shard")
