"""Strategy choice (strategy='auto') on one process: the units and blocks it finds, an estimate that
agrees with the engine's own byte accounting and with itself on the whole graph, never worse than the
fixed schemes, the memory limit, the grid search. Parity of the chosen plans runs on real ranks in
test_hf.py and test_engine_parity.py."""

import math

import pytest
import torch
import transformers

import autopar
from autopar.program.build import capture
from passes.search import strategy as S
from passes.options import Options

CPU = {  # an alpha-beta model in the range `autopar calibrate` measures on gloo here (slow links)
    "version": 1, "source": "test", "grid": [2, 2], "backend": "gloo", "device": "cpu",
    "axes": [{"alpha_s": 2e-4, "beta_bytes_per_s": 2e9, "points": []},
             {"alpha_s": 2e-4, "beta_bytes_per_s": 2e9, "points": []}],
    "flops_per_s": 3e10, "when": "test",
}


def _llama(layers=4, hidden=64, heads=4, kv=2, vocab=256, batch=4, seq=16):
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=seq, use_cache=False)
    with autopar.meta_init():
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, dict(input_ids=ids, labels=ids)


def _gpt2(layers=5, hidden=64, heads=4, vocab=256, batch=4, seq=16):
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
                                  use_cache=False)
    with autopar.meta_init():
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, dict(input_ids=ids, labels=ids)


def _captured(model, kw):
    return capture(model, (), kw).gm


def test_units_group_shared_inputs_and_blocks_share_variables():
    """q|k|v read one activation and gate|up another: one unit each; the 4 layers' units share keys;
    the tied-free LM head and the embedding are units of their own."""
    gm = _captured(*_llama())
    units = S.find_units(gm)
    keys = list(dict.fromkeys(u.key for u in units))
    assert len(units) == 4 * 4 + 2, [u.key for u in units]
    assert len(keys) == 6, keys
    qkv = [u for u in units if "q_proj" in u.key]
    assert len(qkv) == 4 and all(len(u.nodes) == 3 for u in qkv)
    assert all(len(u.nodes) == 2 for u in units if "gate_proj" in u.key)
    blocks = S.repeated_blocks(gm)
    assert blocks is not None and len(blocks) == 4 + 2  # pre, 4 layers, post


def test_tied_head_follows_its_table():
    """GPT-2's LM head is the embedding table: it is no unit (its layout comes from the lookup)."""
    gm = _captured(*_gpt2())
    assert not [u for u in S.find_units(gm) if "lm_head" in u.key]


@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_block_shortcut_equals_the_whole_graph(build):
    """The estimate prices three blocks and scales the middle one: for every fixed assignment tried it
    must equal pricing every node of the graph (time, bytes per axis, parameters, activations)."""
    gm = _captured(*build())
    units = S.find_units(gm)
    keys = list(dict.fromkeys(u.key for u in units))
    ev = S.Evaluator(gm, (2, 2), S.CostModel.from_dict(CPU), units, Options())
    assert ev.blocks is not None
    for i, option in enumerate(["2d", "1d", "rep", "mixed"]):
        assignment = {k: (S.OPTIONS[(i + j) % 3] if option == "mixed" else option) for j, k in enumerate(keys)}
        assignment = {k: (v if v in next(u.options for u in units if u.key == k) else "1d")
                      for k, v in assignment.items()}
        ev._set(assignment)
        short, _trade = ev._truncated()  # (estimate, what recomputing blocks would trade)
        nodes = list(gm.graph.nodes)
        full = S.price(nodes, ev._run(nodes), (2, 2), ev.grads, ev.cm)
        assert short is not None, option
        assert math.isclose(short.time_s, full.time_s, rel_tol=1e-9), (option, short.time_s, full.time_s)
        for a in range(2):
            assert math.isclose(short.bytes_per_axis[a], full.bytes_per_axis[a], rel_tol=1e-12), option
        assert short.param_bytes == full.param_bytes and short.activation_bytes == full.activation_bytes, option


@pytest.mark.parametrize("grid", [(2, 2), (2, 4), (1, 4)])
def test_estimated_bytes_equal_the_engines_plan(grid):
    """The search prices the collectives the insertion pass will add; the plan of the chosen
    assignment, costed by the engine's own formulas, must move exactly those bytes."""
    for build in (_gpt2, _llama):
        model, kw = build()
        pl = autopar.plan(model, grid=grid, example_kwargs=kw, strategy="auto", cost_model=CPU,
                          measure_activations=False)
        est = pl.choice.estimate
        assert round(sum(est.bytes_per_axis)) == pl.comm_bytes_per_rank_per_step, (build.__name__, grid)
        assert est.param_bytes == pl.param_bytes_per_rank, (build.__name__, grid)


def _bench_llama():
    """The benchmark model of `autopar bench` (Llama, h=256, 4 layers, batch 8 x 128), on meta."""
    from autopar.bench.common import BATCH, CONFIG, SEQ

    with autopar.meta_init():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, use_cache=False))
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return model, dict(input_ids=ids, labels=ids)


def test_auto_never_slower_than_any_fixed_scheme():
    """The benchmark model at 4, 16 and 64 ranks, with published GPU figures and with slow (gloo-like)
    links. Fixed schemes: 2D SUMMA, 1D and (on 64 = 4^3) 3D on every arrangement (each R x C grid,
    the cube, replicas of a grid); auto picks the arrangement and the strategy per unit. Its estimate
    is never above any fixed scheme's anywhere, and strictly below the best somewhere."""
    model, kw = _bench_llama()
    gaps = []
    for p in (4, 16, 64):
        for cm in (None, CPU):
            gc = autopar.choose_grid(model, p, (), kw, cost_model=cm)
            best_fixed = min(t for row in gc.table for t in row["fixed_s"].values())
            auto = gc.best["auto_s"]
            assert auto <= best_fixed * (1 + 1e-12), (p, cm, auto, best_fixed)
            assert auto == min(row["auto_s"] for row in gc.table if row["searched"] and row["fits"])
            gaps.append((best_fixed - auto) / best_fixed)
    assert max(gaps) > 0.01, gaps


def test_memory_limit_is_respected_and_an_impossible_one_is_refused():
    model, kw = _llama()
    gm = _captured(model, kw)
    free = S.choose(gm, (2, 2), S.CostModel.from_dict(CPU))
    limit = free.estimate.memory_bytes - 1
    tight = S.choose(gm, (2, 2), S.CostModel.from_dict(CPU), Options(memory_limit=limit))
    assert tight.estimate.memory_bytes <= limit
    assert tight.estimate.time_s >= free.estimate.time_s
    with pytest.raises(MemoryError) as e:
        S.choose(gm, (2, 2), S.CostModel.from_dict(CPU), Options(memory_limit=1.0))
    assert "memory_limit=1 B per rank" in str(e.value) and "smallest estimate" in str(e.value)


def test_choose_grid_covers_every_shape_and_picks_the_fastest():
    """--grid auto: every arrangement of 8 devices is priced (1x8 includes plain 1D tensor parallelism,
    2x2x2 the cube, d x R x C replicas where d divides the batch of 4); the SEARCHED fastest by their
    fixed schemes are searched per unit, and the pick is the searched one with the smallest estimate."""
    from autopar.planning.grids import SEARCHED

    model, kw = _llama(layers=1)
    gc = autopar.choose_grid(model, 8, (), kw, cost_model=CPU)
    grid, table = gc
    assert [(row["layout"], row["grid"]) for row in table] == [
        ("2d", (1, 8)), ("2d", (2, 4)), ("2d", (4, 2)), ("2d", (8, 1)), ("3d", (2, 2, 2)),
        ("replicas", (2, 1, 4)), ("replicas", (2, 2, 2)), ("replicas", (2, 4, 1)),
        ("replicas", (4, 1, 2)), ("replicas", (4, 2, 1))]
    searched = [row for row in table if row["searched"]]
    assert len(searched) == SEARCHED
    assert max(r["screen_s"] for r in searched) <= min(r["screen_s"] for r in table if not r["searched"])
    best = min(row["auto_s"] for row in searched if row["fits"])
    assert gc.best["auto_s"] == best and gc.best["grid"] == grid and sum(r["picked"] for r in table) == 1
    assert gc.kwargs == ({"grid": 8, "strategy": "auto"} if gc.layout == "3d" else {"grid": grid, "strategy": "auto"})


def test_bad_strategy_options_are_refused():
    model, kw = _llama(layers=1)
    expected = "calibration version 7, this autopar reads version 1; re-run `autopar calibrate"
    with pytest.raises(ValueError, match=expected):
        autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy="auto", cost_model={"version": 7},
                     measure_activations=False)
    with pytest.raises(ValueError, match="strategy='3d'"):
        autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy="3d", measure_activations=False)


def test_alternating_search_matches_exhaustive(monkeypatch):
    """Above EXHAUSTIVE assignments the search alternates exact enumeration of the block variables and
    of the others; on a model small enough for both, it must find an assignment as good as the full
    enumeration's, and still not worse than the fixed schemes."""
    model, kw = _llama()
    cm = S.CostModel.from_dict(CPU)
    full = S.choose(_captured(model, kw), (2, 2), cm)
    monkeypatch.setattr(S, "EXHAUSTIVE", 1)
    alt = S.choose(_captured(model, kw), (2, 2), cm)
    assert alt.evaluated < full.evaluated
    assert alt.estimate.time_s <= min(b.time_s for b in alt.baselines.values())
    assert math.isclose(alt.estimate.time_s, full.estimate.time_s, rel_tol=1e-12), (alt.assignment, full.assignment)


TRAINING_FIGURES = {  # (time_s, bytes per axis, memory bytes) of the training-step estimate on 2x2 with CPU
    # the grouped q|k|v and gate|up products (passes.transforms.group_siblings) move x's panel once in the all-gather
    # lowering, which the estimate picks here: axis 1 408768 -> 261312 bytes, 0.0458053224 -> 0.0313 s;
    # each weight gradient's reduce-scatter hidden behind the input gradient's matmul in backward
    # (`estimate.hidden_dw_reduction`): 0.0313315944 -> 0.0312496744 s (gpt2 0.0467799208 -> 0.0466488488 s)
    # the loss's all-reduce over the rows carries a third fp32 (the count of targets out of range):
    # axis 0 +4 bytes, 2d 0.0312496744 -> 0.0312496764 s (gpt2 0.0466488488 -> 0.0466488508 s), 1d alike
    # a GradSync folded into the all-gather before it (reduce-scatter backward instead of all-reduce,
    # `insert_collectives.fold_gradsyncs`): llama 1d axis 1 199296 -> 166528 bytes (the sequence-split
    # norm outputs gathered before q|k|v and gate|up), llama 2d 261312 -> 260736, gpt2 1d 818432 -> 814336
    # a norm's mean square (a per-token statistic) all-reduced, not reduce-scattered and gathered back
    # (`rules.pointwise`): llama 2d 4 calls fewer per norm, 0.0312493884 -> 0.0276493884 s, the same
    # bytes, memory 1571588 -> 1572740 (the statistic saved whole over the columns)
    ("_llama", "2d"): (0.027649388400000002, [500876, 260736], 1572740),
    ("_llama", "1d"): (0.0182068284, [346124, 166528], 2427780),
    # c_attn's plain weight and bias blocks regrouped to interleaved ones by an all-to-all of the chunks other
    # columns hold, not an all-gather and a cut (`passes.ops.reblock.regroup`): gpt2 2d axis 1 613376 -> 528896
    # bytes, 0.0466488508 -> 0.0466066108 s; gpt2 1d axis 1 447488 -> 314368, 0.0327721148 -> 0.0327055548 s
    ("_gpt2", "2d"): (0.0466066108, [803212, 528896], 2749956),
    # LayerNorm on sequence blocks under 1d (`rules.norms`: a partial sum is reduce-scattered onto the
    # sequence, not the hidden dim that turned the next products into row splits): gpt2 1d axis 0
    # 554380 -> 553484, axis 1 814336 -> 484352 bytes, memory 4441604 -> 4024324, 0.0393560 -> 0.0327905 s
    # the GradSync of the Conv1D's 2-D view of a gathered activation moved before the view and folded into
    # the gather (`insert_collectives.hoist_gradsyncs`): a reduce-scatter instead of an all-reduce in backward,
    # gpt2 1d axis 1 484352 -> 447488 bytes, 0.0327905 -> 0.0327721 s
    ("_gpt2", "1d"): (0.032705554799999995, [553484, 314368], 4024324),
}


@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_forward_only_prices_a_forward_and_training_figures_stay(build):
    """Catches a forward-only mode that leaks into the training estimate (the figures of a training
    step are pinned as they were before the mode existed), and a forward-only estimate that still
    counts backward bytes, saved activations or gradient and optimizer state: its bytes must equal
    the forward bytes of the plan the engine builds, its memory the parameter blocks alone."""
    cm = S.CostModel.from_dict(CPU)
    for strategy in ("2d", "1d"):
        train = S.estimate_fixed(_captured(*build()), (2, 2), cm, strategy)
        want_t, want_bytes, want_mem = TRAINING_FIGURES[(build.__name__, strategy)]
        assert math.isclose(train.time_s, want_t, rel_tol=1e-12), (strategy, train.time_s)
        assert [int(b) for b in train.bytes_per_axis] == want_bytes and int(train.memory_bytes) == want_mem, strategy
        # priced at the broadcast lowering, which `autopar.plan` below builds (the default, lowering='auto',
        # would give each product the lowering a training step's estimate prefers)
        fwd = S.estimate_fixed(_captured(*build()), (2, 2), cm, strategy, Options(forward_only=True), "broadcast")
        model, kw = build()
        pl = autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy=strategy, measure_activations=False,
                          lowering="broadcast")
        assert round(sum(fwd.bytes_per_axis)) == pl.comm_bytes_fwd, (strategy, fwd.bytes_per_axis, pl.comm_bytes_fwd)
        assert fwd.activation_bytes == 0 and fwd.memory_bytes == fwd.param_bytes == train.param_bytes, strategy
        assert fwd.time_s < train.time_s, strategy
    with pytest.raises(ValueError, match="forward_only=1: expected True"):
        Options(forward_only=1)
