"""pmodel.generate: token identity with the unmodified model's generate, on every rank, at 2x2 and
1x4; the KV cache's bytes per rank against the formula; the refusals' texts."""

import math

import pytest
import torch

from autopar.generate.cache import kv_cache_bytes_per_rank
from tests import checks_generate as C

FAMILIES = ["llama", "llama_gqa", "mistral", "qwen2", "gemma", "phi3", "gpt2"]


def _same_tokens(res, what):
    for rank, (want, got, *_) in enumerate(res):
        assert got == want, f"{what}: rank {rank}: pmodel.generate {got}\n  unmodified model {want}"


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_token_identical(pool4, family, grid):
    """Catches a cache written at the wrong slot or block, a decode step that misreads the prefix
    (rotary positions of a left-padded row, Mistral's window of 6 < 13 tokens, GQA's repeated KV
    heads, GPT-2's fused c_attn), and a rank whose tokens differ from the others'."""
    _same_tokens(pool4.run(C.greedy, family, grid), f"{family} {grid}")


@pytest.mark.parametrize("strategy", ["1d", "auto"])
def test_greedy_with_other_strategies(pool4, strategy):
    """Catches generation programs that cannot repeat the forward's strategy (auto's units are keyed
    by module path: the cache wrapper's paths must match the model's) or its 1D weight layouts."""
    _same_tokens(pool4.run(C.greedy, "llama", (2, 2), strategy=strategy), f"llama 2x2 {strategy}")


@pytest.mark.parametrize("strategy,prefill,decode", [("2d", "2d", "1d"), ("auto", None, None)])
def test_a_strategy_per_phase(pool4, strategy, prefill, decode):
    """Catches a phase planned with its own strategy reading the stored blocks as if laid out for it
    (its parameters must be copied into its layouts), copies made again by a second generate with the
    same weights, copies kept stale after an optimizer step (tokens must equal one process's with the
    trained weights), an 'auto' model whose phases do not default to their own search, and explain not
    showing each phase's plan, estimated forward time and lowering."""
    res = pool4.run(C.phase_strategies, prefill, decode, strategy)
    for rank, (want, got, again, text, first, second, after, writes) in enumerate(res):
        for how, (one, par) in writes.items():  # tokens after a write no version counter sees matched neither
            assert par == one, f"rank {rank}: after {how} pmodel {par}\n  one process with those weights {one}"
        assert got == want and again == want, f"rank {rank}: {got} / {again}\n  unmodified model {want}"
        kept, made = first
        assert kept == made and second == first, f"rank {rank}: (kept, made) {first}, after a second call {second}"
        if strategy == "2d":
            assert kept > 0, f"rank {rank}: decode 1d on a 2d model kept no copy"
            assert "parameter copies for the phases' own plans" in text, text
        trained, got_trained, made_after, moved = after
        assert moved > 1e-4, f"rank {rank}: the step did not move the weights ({moved})"
        assert got_trained == trained, f"rank {rank}: after a step {got_trained}\n  trained copy {trained}"
        assert made_after == made + kept, f"rank {rank}: copies made {made_after}, expected {made} + {kept} refreshed"
        prefill_text, decode_text = text.split("  decode ")[:2]
        assert f"{prefill or 'auto'} (this phase's own)" in prefill_text.split("  prefill ")[1], text
        assert f"{decode or 'auto'} (this phase's own)" in decode_text, text
        assert "estimated forward" in prefill_text and "estimated forward" in decode_text, text
        assert "SUMMA lowering" in prefill_text or "no SUMMA product" in prefill_text, text


def test_phase_strategy_defaults_follow_the_model():
    """Catches a default that ignores the model's strategy ('auto' plans each phase, '2d'/'1d' keep the
    forward's plan), 'forward' not meaning the forward's plan, and an unknown value accepted."""
    from types import SimpleNamespace

    from autopar.generate.phases import phase_strategy

    def pm(strategy, world=4):
        return SimpleNamespace(options=SimpleNamespace(strategy=strategy), grid=SimpleNamespace(world=world))
    assert phase_strategy(pm("auto"), "decode_strategy", None) == "auto"
    assert phase_strategy(pm("auto", world=1), "decode_strategy", None) is None
    assert phase_strategy(pm("2d"), "decode_strategy", None) is None
    assert phase_strategy(pm("1d"), "prefill_strategy", None) is None
    assert phase_strategy(pm("auto"), "prefill_strategy", "forward") is None
    assert phase_strategy(pm("2d"), "decode_strategy", "1d") == "1d"
    with pytest.raises(ValueError, match="decode_strategy='3d': expected None \\(follow the model's strategy"):
        phase_strategy(pm("2d"), "decode_strategy", "3d")


def test_generate_compiled(pool4):
    """Catches generation programs that do not run under compile=True, break into several graphs, or
    compile again per decode step or per call (one graph per program key, none on a second call)."""
    for rank, (want, got, again, stats, recompiled) in enumerate(pool4.run(C.compiled, timeout=900)):
        assert got == want and again == want, f"rank {rank}: {got} / {again}\n  unmodified model {want}"
        assert stats == {"prefill": (1, 0), "decode": (1, 0)}, f"rank {rank}: (graphs, breaks) {stats}"
        assert recompiled == 0, f"rank {rank}: {recompiled} graphs compiled by a second generate"


def test_sampling_identical_given_the_seed(pool4):
    """Catches a sampler that draws other numbers than transformers' (temperature, top-k, top-p
    warpers in its order, one multinomial per step) or that differs between ranks; and, with a
    different seed on each rank (rank r: 5 + 100 r), tokens that differed on every rank: now every
    rank returns rank 0's draw, which is one process's draw under rank 0's seed."""
    res = pool4.run(C.sampling)
    _same_tokens([r[:2] for r in res], "sampling")
    for rank, (want, _, per_rank) in enumerate(res):
        assert per_rank == want, f"rank {rank}: per-rank seeds {per_rank}\n  rank 0's seed, one process {want}"


def test_eos_stops_rows_and_dict_output(pool4):
    """Catches rows that keep generating after their eos (they must get pad tokens), a loop that
    does not stop when all rows finished, and scores that differ from transformers'."""
    res = pool4.run(C.eos_and_dict)
    _same_tokens(res, "eos")
    for rank, (want, _, same_steps, worst) in enumerate(res):
        assert want[1][-1] == 0, f"rank {rank}: row 1 should end padded: {want[1]}"
        assert same_steps and worst < 1e-4, f"rank {rank}: scores differ by {worst} (steps alike: {same_steps})"


def test_generate_right_after_training(pool4):
    """Catches a generate that reads the weights the model was parallelized with instead of the
    trained blocks (the weights did move: checked)."""
    res = pool4.run(C.after_training)
    _same_tokens(res, "after training")
    assert all(r[2] > 1e-4 for r in res), [r[2] for r in res]


def test_generate_after_from_pretrained(pool4, tmp_path):
    """Catches a generate that cannot run on a model built on the meta device and loaded blocks."""
    C.build("qwen2").save_pretrained(tmp_path)
    _same_tokens(pool4.run(C.pretrained, str(tmp_path)), "from_pretrained")


@pytest.mark.parametrize("family,grid,block", [("llama_gqa", (2, 2), [2, 1, 32, 8]),
                                                ("llama", (1, 4), [4, 1, 32, 8]),
                                                ("llama_gqa", (1, 4), [4, 1, 32, 8]),
                                                ("gpt2", (2, 2), [2, 2, 32, 8])])
def test_cache_bytes_per_rank(pool4, family, grid, block):
    """Catches a cache held whole (or split other than batch over rows, KV heads over columns) and a
    formula that disagrees with what ranks allocate: 2 * layers * B/R * kv/C * L * head_dim * 4. With
    2 KV heads on 4 columns each column keeps the one KV head its query head reads (1 = lcm(2, 4)/4)."""
    layers, batch, length, head_dim = 1, 4, 32, 8
    kv = 2 if family == "llama_gqa" else 4
    per_column = 1 if (family, grid) == ("llama_gqa", (1, 4)) else kv // grid[1]
    formula = 2 * layers * (batch // grid[0]) * per_column * length * head_dim * 4
    for rank, (held, reported, shape, text) in enumerate(pool4.run(C.cache_bytes, family, grid)):
        assert held == reported == formula, f"rank {rank}: held {held}, reported {reported}, formula {formula}"
        assert shape == block, f"rank {rank}: block {shape}"
        assert f"kv_cache_bytes_per_rank {formula} " in text, text
        assert "prefill (B=4 P=7, cache L=32)" in text and "decode  (B=4, one token each, cache L=32)" in text, text


def test_plan_reports_cache_bytes():
    """Catches autopar.plan's kv_cache_bytes_per_rank disagreeing with the formula (on one process)."""
    import autopar
    model = C.build("llama_gqa")
    ids, mask = C.prompts()
    pl = autopar.plan(model, (2, 2), (ids,), {"attention_mask": mask}, generation=(8, 128), measure_activations=False)
    assert pl.kv_cache_bytes_per_rank == 2 * 1 * (8 // 2) * (2 // 2) * 128 * 8 * 4  # k and v, 1 layer, head_dim 8
    assert pl.to_json()["kv_cache_bytes_per_rank"] == pl.kv_cache_bytes_per_rank


def test_inference_saves_nothing_for_backward(pool4):
    """Catches a forward under no_grad / inference_mode, or a generate, that still records autograd
    state (saved activations, outputs needing a gradient) or leaves gradients on parameters."""
    for rank, r in enumerate(pool4.run(C.inference)):
        assert r["grad mode forward"] > 0, f"rank {rank}: the saved-tensor counter saw nothing in grad mode"
        for mode in ("no_grad", "inference_mode", "generate"):
            assert r[mode] == (0, False), f"rank {rank}: {mode}: (saved tensors, requires_grad) = {r[mode]}"
        assert not r["grads"], f"rank {rank}: gradients after inference: {r['grads'][:3]}"


def test_cache_bytes_formula_without_ranks():
    """Catches the planning function drifting from the formula (Llama-7B shape on 8x8, fp16)."""
    import transformers
    cfg = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                   num_key_value_heads=32)
    assert kv_cache_bytes_per_rank(cfg, 8, 4096, (8, 8), torch.float16) == 2 * 32 * 1 * 4 * 4096 * 128 * 2
    assert kv_cache_bytes_per_rank(cfg, 1, 4096, (8, 8), torch.float16) == 2 * 32 * 1 * 4 * 4096 * 128 * 2 * 1


def test_refusals(pool4):
    """Every refusal names what was wrong and what to do."""
    for r in pool4.run(C.errors):
        assert r["beyond cache"].startswith("UsageError") and "max_cache_len=16" in r["beyond cache"], r
        assert "beam search is not supported" in r["beams"], r
        assert "keywords it does not take: ['beam_width']" in r["unknown"], r
        assert r["batch differs"].startswith("UsageError") and "different generations" in r["batch differs"], r
        assert "ranks [1]" in r["ids differ"] and "input_ids hash" in r["ids differ"], r
        assert "different generations" in r["new tokens differ"] and "max_length (9 vs 10)" in r["new tokens differ"], r
        assert r["one process, id out of range"].startswith("IndexError"), r  # a prompt id >= vocab
        assert r["id out of range"].startswith("IndexRangeError") and f"id {C.VOCAB + 3} is outside [0, " \
            f"{C.VOCAB})" in r["id out of range"], r
        assert "needs a causal language model" in r["not causal"] and "LlamaModel" in r["not causal"], r
        assert "encoder-decoder" in r["t5"] and "cross-attention cache" in r["t5"], r


def test_projection_searches_each_phase():
    """Catches a per-phase search priced as a training step or worse than a fixed scheme: on a tiny
    Llama at 2x2 each phase's 'auto' estimate is at most the better of fixed 2d and 1d (forward only)."""
    import transformers

    from autopar.generate.plan import project
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    rows = {s: project(model, (2, 2), batch=4, prompt=8, max_len=16, strategy=s) for s in ("2d", "1d", "auto")}
    for i, phase in enumerate(("prefill", "decode")):
        best_fixed = min(rows["2d"][i]["estimated_s"], rows["1d"][i]["estimated_s"])
        assert rows["auto"][i]["phase"] == phase and rows["auto"][i]["assignment"], rows["auto"][i]
        assert rows["auto"][i]["estimated_s"] <= best_fixed * (1 + 1e-12), (phase, rows)


UNEVEN_CACHE = [((2, 2), 3, 3, 3), ((2, 2), 1, 4, 4), ((1, 4), 2, 3, 3), ((2, 2), 3, 4, 2)]


def test_cache_split_in_unequal_blocks(pool4):
    """Catches a cache kept whole where the grid does not divide it (batch 3 or 1 on 2 rows, 3 heads on
    2 or 4 columns), blocks that disagree with the activations' torch.chunk blocks (tokens would then
    differ from the unmodified model's), and a reported figure other than the largest block's."""
    res = pool4.run(C.uneven_cache, UNEVEN_CACHE)
    for i, (grid, batch, heads, kv) in enumerate(UNEVEN_CACHE):
        largest = 0
        for rank, per_case in enumerate(res):
            same, shape, held, reported = per_case[i]
            r, c = divmod(rank, grid[1])
            rows = [len(b) for b in torch.arange(batch).chunk(grid[0])] + [0] * grid[0]
            cols = [len(b) for b in torch.arange(kv).chunk(grid[1])] + [0] * grid[1]
            want = [rows[r], cols[c] if kv == heads else kv // grid[1], 32, 16]  # k and v of one layer: 2x
            assert same, f"case {i} rank {rank}: tokens differ from the unmodified model's"
            assert shape == want, f"case {i} rank {rank}: key block {shape}, expected {want}"
            assert held == 2 * math.prod(want) * 4, f"case {i} rank {rank}: held {held} B for blocks {want}"
            largest = max(largest, held)
        reported = {per_case[i][3] for per_case in res}
        assert reported == {largest}, f"case {i}: reported {reported}, largest block {largest}"
