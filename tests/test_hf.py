"""transformers models on a 2x2 grid: parity with the unmodified model on one process.

Built from config classes with tiny sizes (nothing downloaded). Each family checks logits, the HF loss
with labels and every parameter gradient on every rank, element-wise (fp32: rtol 1e-4 plus an atol of
1e-5 x the largest reference value of the outputs / of all gradients; tests/compare.py) at the example
shape and at another batch size and sequence length, and records the fraction of parameters each rank
holds.
"""

import pytest
import torch

from tests import checks_hf as C
from tests.compare import assert_every_rank

FAMILIES = ["gpt2", "bert", "llama", "mistral", "qwen2", "opt", "vit", "t5"]


def _parity(res, what):
    """Every rank's logits, losses and gradients within tolerance; no op gathered whole on any rank."""
    assert_every_rank([r["excess"] for r in res], what)
    for rank, r in enumerate(res):
        assert not r["warned"], f"{what}: rank {rank}: ops gathered whole: {r['warned']}"


def _check(res, family, max_fraction=1.3):
    _parity(res, family)
    for rank, r in enumerate(res):
        assert not r["unsplit_2d"], f"{family}: rank {rank}: 2-D weights not split 2D: {r['unsplit_2d']}"
        assert r["fraction"] <= max_fraction, f"{family}: rank {rank} holds {r['fraction']:.2f}/p of the parameters"
    print(f"{family}: parameters per rank {max(r['fraction'] for r in res):.2f}/p")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_parity(pool4, family):
    """Catches per-family breakage: GPT-2's Conv1D and fused c_attn, BERT's padding mask and token
    types, Llama/Mistral/Qwen2 rotary embeddings and grouped-query attention (Mistral: 1 KV head on 2
    columns), OPT's learned offset positions, ViT's conv patch embedding, T5's relative position bias
    and encoder-decoder cross-attention, and in all of them the tied or untied LM head and HF's loss."""
    _check(pool4.run(C.hf_parity, family), family)


def test_gpt2_explain_shows_fused_qkv_and_vocab_parallel_loss(pool4):
    """The user-visible plan: c_attn stored interleaved, the loss computed on the split vocabulary,
    nothing on the hot path gathered whole."""
    text = pool4.run(C.hf_parity, "gpt2")[0]["explain"]
    assert text.count("fused x3") == 1, text  # one c_attn per layer, one layer
    assert "VocabParallelCrossEntropy" in text and "vocab-parallel cross-entropy" in text
    for line in text.splitlines():
        if line.startswith(("addmm", "linear")):
            assert "SummaLinear" in line, line


@pytest.mark.parametrize("over,batch", [
    (dict(n_embd=48, n_head=3), 4),  # 3 heads on 2 columns (GPT-2-XL has 25)
    (dict(vocab_size=65), 4),  # a vocabulary not divisible by q
    ({}, 3),  # a batch not divisible by q
])
def test_gpt2_indivisible_sizes_stay_correct(pool4, over, batch):
    """Sizes q does not divide fall back to unsplit or differently split ops, never to wrong numbers."""
    res = pool4.run(C.hf_parity, "gpt2", over, batch, 8, (batch, 6))
    assert_every_rank([r["excess"] for r in res], f"gpt2 {over} batch {batch}")


def test_trainer_style_summed_loss(pool4):
    """transformers' Trainer passes num_items_in_batch, and the model then sums the token losses and
    divides: the in-graph cross-entropy must support reduction='sum' without gathering the logits."""
    res = pool4.run(C.hf_parity, "llama", None, 4, 8, (4, 8), dict(num_items_in_batch=torch.tensor(17)))
    _parity(res, "llama, summed loss")


def test_modes_and_kv_cache(pool4):
    """Dropout on in train(), off in eval() with parity restored; a cache request is refused clearly,
    and the user's config is left as it was."""
    res = pool4.run(C.hf_modes_and_cache)
    assert_every_rank([r["eval parity"] for r in res], "eval after train")
    for rank, r in enumerate(res):
        assert r["train masks differ"] > 0, f"rank {rank}: two train-mode calls drew the same dropout masks"
        assert r["config use_cache kept"], f"rank {rank}"
        assert "use_cache=True asks for a generation KV cache" in r["cache error"], (rank, r["cache error"])


SLOW_LINKS = {  # links slow against compute: the search then keeps some matmuls 2D (an input, not an output)
    "version": 1, "source": "test", "grid": [2, 2], "backend": "gloo", "device": "cpu",
    "axes": [{"alpha_s": 1e-6, "beta_bytes_per_s": 1e9, "points": []},
             {"alpha_s": 1e-6, "beta_bytes_per_s": 1e9, "points": []}],
    "flops_per_s": 1e9, "when": "test",
}


@pytest.mark.parametrize("family,grid,options", [
    ("gpt2", (2, 2), dict(strategy="auto")),
    ("gpt2", (2, 2), dict(strategy="auto", cost_model=SLOW_LINKS)),
    ("llama", (2, 2), dict(strategy="auto")),
    ("gpt2", (2, 2), dict(strategy="1d")),
    ("llama", (1, 4), dict(strategy="1d")),
    ("llama", (4, 1), dict(strategy="2d")),
    ("llama", (2, 2), dict(strategy="2d", lowering="allgather")),
    ("llama", (2, 2), dict(strategy="2d", lowering="ring")),
], ids=["gpt2-auto", "gpt2-auto-slow-links", "llama-auto", "gpt2-1d", "llama-1d-1x4", "llama-2d-4x1",
        "llama-2d-allgather-grouped", "llama-2d-ring"])
def test_strategies_parity(pool4, family, grid, options):
    """Every strategy, and the mixed plans strategy='auto' builds (1D column/row splits next to 2D
    SUMMA and replicated weights, with the all-reduces between them), against the unmodified model:
    logits, loss and every gradient, also at a second shape (which reuses the first choice)."""
    res = pool4.run(C.hf_parity, family, None, 4, 8, (8, 12), None, grid, options)
    _parity(res, f"{family} {grid} {options}")
    if options.get("lowering") == "allgather":  # q|k|v (unequal: 2 KV heads) and gate|up share their calls
        assert res[0]["explain"].count("SummaGroup(AB x3") == 1, res[0]["explain"]  # q|k|v of the one layer
        assert res[0]["explain"].count("SummaGroup(AB x2") == 1, res[0]["explain"]  # gate|up of the one layer
    assignment = res[0]["assignment"]
    if options["strategy"] == "auto":
        # a mixed plan, not one fixed scheme (with slow links SUMMA may take every unit: GPT-2's c_attn moves
        # only the chunks of its weight other columns hold since the regroup became an all-to-all)
        assert len(set(assignment.values())) >= 2 or options.get("cost_model") is SLOW_LINKS, assignment
        assert all(r["assignment"] == assignment for r in res)  # every rank chose the same
        assert "[auto: " in res[0]["explain"] and "strategy auto: estimated step" in res[0]["explain"]
    if options.get("cost_model") is SLOW_LINKS:
        assert any(v == "2d" for k, v in assignment.items() if k.startswith("matmul")), assignment


@pytest.mark.parametrize("fused", ["interleave", "regroup"])
def test_gpt2_1d_matches_one_process(pool4, fused):
    """GPT-2's Conv1D multiplies a [b*s, h] view of the gathered activation: the gradient all-reduce on
    that view now runs before it, folded into the gather's backward (a reduce-scatter). Catches a moved
    GradSync that sums the wrong tensor or the wrong axis: logits, loss and every gradient on every rank
    against one process, 1D on 1x4, both ways of storing the fused c_attn weight."""
    res = pool4.run(C.hf_parity, "gpt2", None, 4, 8, (4, 12), None, (1, 4), {"strategy": "1d", "fused": fused})
    assert_every_rank([r["excess"] for r in res], f"gpt2 1d {fused}")


def _block_bytes(family, batch, t=4, seq=8):
    """Bytes per rank of one block's 1D collectives (a two-block plan less a one-block plan, fused
    projections stored interleaved), and Megatron-SP's for the same block: an all-gather and a
    reduce-scatter per sublayer each way, (t - 1)/t of the [b, s, h] fp32 activation each, plus the
    two LayerNorms' weight and bias gradients all-reduced."""
    import warnings

    import autopar

    def total(layers):
        over = {"n_layer": layers} if family == "gpt2" else {"num_hidden_layers": layers}
        model, make = C.build(family, **over)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(model, grid=(1, t), example_kwargs=make(batch, seq, 1), strategy="1d",
                                fused="interleave").comm_bytes_per_rank_per_step

    h = 32
    norms = 4 * 2 * (t - 1) * h * 4 // t
    return total(2) - total(1), 8 * (t - 1) * batch * seq * h * 4 // t + norms


@pytest.mark.parametrize("family, batch", [("gpt2", 1), ("gpt2", 2), ("opt", 1)])
def test_1d_of_one_sequence_moves_what_megatron_sp_moves(family, batch):
    """A 1 x t grid's size-1 row axis splits nothing; it used to take the token dim (a matmul or norm
    split 'the first lead dim' over it), which pushed the columns' sequence split onto a batch dim of
    one: GPT-2 then moved 21x Megatron-SP's bytes per block with one sequence per micro-batch, OPT
    (which flattens tokens before its MLP) 5.6x, its LayerNorms hidden-split and fc1 row-parallel with
    a 4h-wide partial sum. Now a block moves exactly Megatron-SP's bytes."""
    got, megatron_sp = _block_bytes(family, batch)
    assert got == megatron_sp, (family, batch, got, megatron_sp)


def test_opt_1d_of_one_sequence_matches_one_process(pool4):
    """OPT's 1D plan with one sequence (norms on sequence blocks of the flattened tokens, whole over
    the columns where 1D column splits read them): logits, loss and every gradient on every rank
    against one process at 1 x 4."""
    res = pool4.run(C.hf_parity, "opt", None, 1, 8, None, None, (1, 4), {"strategy": "1d", "fused": "interleave"})
    _parity(res, "opt 1d, one sequence")


def test_gpt2_1d_moves_what_megatron_sp_moves():
    """With fused='interleave' and a batch the columns divide, a GPT-2 block's 1D collectives are
    Megatron's with sequence parallelism: an all-gather and a reduce-scatter per sublayer each way,
    (t - 1)/t of the [b, s, h] activation each, and the two LayerNorms' weight and bias gradients
    all-reduced (Megatron's sequence parallelism sums them over the group too); nothing else (it was
    1.25x: the backward of the gather before each Conv1D was an all-reduce of the whole gradient). The
    plan's bytes are what a real step counts (tests/test_plan.py); the estimate prices the same."""
    import math

    import autopar
    from transformers import GPT2Config, GPT2LMHeadModel

    from passes import capture
    from passes.cost.model import CostModel
    from passes.options import Options
    from passes.search.strategy import estimate_fixed

    b, s, h, t = 4, 16, 64, 4
    cfg = GPT2Config(n_embd=h, n_layer=3, n_head=4, vocab_size=256, n_positions=64, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(b, s, dtype=torch.long)
    plan = autopar.plan(model, grid=(1, t), example_kwargs={"input_ids": ids, "labels": ids}, strategy="1d",
                        fused="interleave")
    block = [r for r in plan.rows if r.module.startswith("transformer.h.1.") and (r.fwd_bytes or r.bwd_bytes)]
    norms = 4 * 2 * (t - 1) * h * 4 // t  # all-reduce of ln_1 and ln_2's [h] weight and bias gradients
    assert sum(r.fwd_bytes + r.bwd_bytes for r in block) == 8 * (t - 1) * b * s * h * 4 // t + norms, \
        [(r.node, r.fwd_bytes, r.bwd_bytes) for r in block]
    gm = capture(model, (), {"input_ids": ids.to("meta"), "labels": ids.to("meta")}).gm
    est = estimate_fixed(gm, (1, t), CostModel((0.0, 0.0), (1.0, 1.0), math.inf, "bytes"), "1d",
                         Options(strategy="1d", fused="interleave"))
    assert sum(est.bytes_per_axis) == plan.comm_bytes_per_rank_per_step
