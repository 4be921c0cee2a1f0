"""Activation recomputation (parallelize(..., recompute=...)) on real gloo ranks: parity with one
process, the same dropout masks when recomputed, and planned = counted for the bytes communicated
again and the bytes saved for backward. Also the pass on one process: which regions it groups."""

import json

import pytest
import torch

import autopar
from models import GPTConfig, TinyGPT
from autopar.program.build import compile_program
from passes.mesh import Grid
from passes.meta import RECOMPUTE
from passes.options import Options
from passes.transforms.recompute import KEPT
from passes.nodes import block_of
from tests import checks_engine as E
from tests import checks_hf as H
from tests import checks_recompute as C
from tests.compare import ATOL_FRAC, RTOL, assert_every_rank
from tests.conftest import get_pool

SMALL = dict(vocab_size=64, max_seq=16, hidden=32, heads=4, layers=1)
GRIDS = [(2, 2), (1, 4)]
MODES = ["blocks", "selective"]


@pytest.mark.parametrize("grid", GRIDS, ids=["2x2", "1x4"])
@pytest.mark.parametrize("mode", MODES)
def test_tinygpt_parity(grid, mode):
    """Catches a recomputed region that computes another value than its forward did (a wrong input
    order, a lost gradient through the checkpoint boundary, a block input freed too early) or ranks
    that recompute in different orders (a hang): outputs, every gradient and the parameters after 3
    AdamW steps against the unmodified model on one process."""
    res = get_pool(4).run(E.gpt_parity, grid, dict(SMALL, norm="rmsnorm", mlp="swiglu"), "broadcast", 4, 8, 3,
                          recompute=mode)
    assert_every_rank([r["excess"] for r in res], f"{grid} {mode} (rtol {RTOL}, atol {ATOL_FRAC} x group max)")


@pytest.mark.parametrize("family,grid,mode", [("llama", (2, 2), "blocks"), ("llama", (1, 4), "selective"),
                                              ("gpt2", (2, 2), "selective"), ("gpt2", (1, 4), "blocks")])
def test_hf_parity(family, grid, mode):
    """HF Llama (rotary, grouped-query attention, SwiGLU) and GPT-2 (Conv1D, fused c_attn) built from
    config classes: logits, loss and every gradient at two input shapes against one process."""
    res = get_pool(4).run(H.hf_parity, family, grid=grid, options={"recompute": mode})
    assert_every_rank([r["excess"] for r in res], f"{family} {grid} {mode}")
    for rank, r in enumerate(res):
        assert not r["warned"], f"{family}: rank {rank}: ops gathered whole: {r['warned']}"


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_uneven_splits_parity(mode):
    """Recomputation on dims the grid splits unevenly (GPT-2 with a vocabulary of 97 and 3 heads on
    2x2: torch.chunk blocks of 49/48 rows and 2/1 heads): catches a selective check or a recomputed
    region that assumes equal blocks. Logits, loss and every gradient at two input shapes."""
    over = {"vocab_size": 97, "n_embd": 24, "n_head": 3}
    res = get_pool(4).run(H.hf_parity, "gpt2", over, grid=(2, 2), options={"recompute": mode})
    assert_every_rank([r["excess"] for r in res], f"gpt2 uneven 2x2 {mode}")
    for rank, r in enumerate(res):
        assert not r["warned"], f"rank {rank}: ops gathered whole: {r['warned']}"


@pytest.mark.parametrize("grid,mode", [((2, 2), "blocks"), ((2, 2), "selective"), ((1, 4), "blocks")])
def test_dropout_masks_redrawn_identically(grid, mode):
    """Catches a recomputation that draws fresh dropout masks (its gradients would belong to another
    forward): with dropout 0.2, the model with recomputation and the one without, seeded alike, give
    the same outputs, gradients and parameters after 2 steps."""
    res = get_pool(4).run(C.dropout_same_masks, grid, mode)
    assert_every_rank(res, f"dropout {grid} {mode}")


@pytest.mark.parametrize("grid,mode", [((2, 2), "blocks"), ((1, 4), "blocks"), ((2, 2), "selective")])
def test_planned_equals_counted(grid, mode):
    """Catches recomputed collectives counted as forward bytes, or planned bytes that drift from what
    runs: one training step's counted bytes per phase equal explain's rows (forward, backward, and the
    forward collectives that recomputation repeats), and so do the collective calls (the plan's
    `collectives_per_rank_per_step` includes the repeated ones), and rank 0's bytes saved for backward equal
    `autopar.plan`'s measurement; 'blocks' repeats bytes and saves less than no recomputation."""
    res = get_pool(4).run(C.counted, grid, mode)
    for rank, r in enumerate(res):
        counted = {k: r["counted"].get(k, 0) for k in ("fwd", "bwd", "recompute")}
        assert counted == r["planned"], f"rank {rank}: counted {counted} != planned {r['planned']}"
        assert r["calls"] == r["planned_calls"], f"rank {rank}: calls {r['calls']} != planned {r['planned_calls']}"
    torch.manual_seed(0)
    cfg = GPTConfig(**C.SWIGLU)
    ids, tgt = E._data(cfg, 4, 8)
    plans = {m: autopar.plan(TinyGPT(cfg), grid=grid, example_inputs=(ids, tgt), recompute=m) for m in (None, mode)}
    pl = plans[mode]
    assert res[0]["saved"] == pl.activation_bytes, (res[0]["saved"], pl.activation_bytes)
    assert pl.recompute_bytes == res[0]["planned"]["recompute"]
    assert pl.collectives_per_rank_per_step == sum(res[0]["calls"].values())
    assert pl.to_json()["recompute_bytes_per_rank"] == pl.recompute_bytes
    assert pl.activation_bytes < plans[None].activation_bytes, (mode, pl.activation_bytes, plans[None].activation_bytes)
    if mode == "blocks":
        assert pl.recompute_bytes > 0 and "regions run again in backward" in res[0]["explain"]
    else:
        assert pl.recompute_bytes == 0


def test_regions_of_the_pass():
    """Catches a grouping that crosses blocks or wraps communication in 'selective': every node
    marked for recomputation lies in one numbered block and every region in one block; 'selective'
    marks no inserted module and no matmul; 'blocks' makes one region per layer holding its SUMMAs."""
    torch.manual_seed(0)
    cfg = GPTConfig(**dict(SMALL, layers=2), norm="rmsnorm", mlp="swiglu")  # two blocks: a region may cross
    ids, tgt = E._data(cfg, 4, 8)
    for mode in MODES:
        comp, _ = compile_program(TinyGPT(cfg), (ids, tgt), {}, Grid.for_planning(2, 2), Options(recompute=mode))
        marked = [n for n in comp.flat.graph.nodes if RECOMPUTE in n.meta]
        assert marked, mode
        regions = {}
        for n in marked:
            regions.setdefault(n.meta[RECOMPUTE], set()).add(block_of(n))
        assert all(len(b) == 1 for b in regions.values()), regions
        assert {b for bs in regions.values() for b in bs} == {"blocks.0", "blocks.1"}
        if mode == "blocks":
            assert len(regions) == 2
            summas = [n for n in marked if n.op == "call_module" and "summa" in str(n.target)
                      and "summa_group" not in str(n.target)]  # a group's members are its products
            assert len(summas) == 2 * 7, summas  # q, k, v, proj, gate, up, down per layer
        else:
            assert not [n for n in marked if n.op == "call_module" or n.target in KEPT]


def test_some_blocks_recomputed_parity_and_regions():
    """recompute='blocks' with recompute_blocks=1 on a 2-block TinyGPT: only blocks.0 is recomputed (its one
    region), blocks.1 keeps its activations; outputs, every gradient and the parameters after 3 AdamW steps
    against one process on 2x2. Catches a count that recomputes every block or none, or a wrong one."""
    torch.manual_seed(0)
    cfg = GPTConfig(**dict(SMALL, layers=2), norm="rmsnorm", mlp="swiglu")
    ids, tgt = E._data(cfg, 4, 8)
    comp, _ = compile_program(TinyGPT(cfg), (ids, tgt), {}, Grid.for_planning(2, 2),
                              Options(recompute="blocks", recompute_blocks=1))
    regions = {}
    for n in comp.flat.graph.nodes:
        if RECOMPUTE in n.meta:
            regions.setdefault(n.meta[RECOMPUTE], set()).add(block_of(n))
    assert list(regions.values()) == [{"blocks.0"}], regions
    res = get_pool(4).run(E.gpt_parity, (2, 2), dict(SMALL, layers=2, norm="rmsnorm", mlp="swiglu"), "broadcast", 4, 8,
                          3, recompute="blocks", recompute_blocks=1)
    assert_every_rank([r["excess"] for r in res], "2x2 blocks, first 1 of 2")
    with pytest.raises(ValueError, match=r"recompute_blocks=1 with recompute=None: .* pass recompute='blocks'"):
        autopar.plan(torch.nn.Linear(4, 4), grid=(2, 2), example_inputs=(torch.randn(2, 4),), recompute_blocks=1)


def test_recompute_option_is_validated():
    """A misspelt mode is refused before anything is captured, naming the value and the choices."""
    with pytest.raises(ValueError, match=r"recompute='block': expected None .*'blocks'.*'selective'"):
        autopar.plan(torch.nn.Linear(4, 4), grid=(2, 2), example_inputs=(torch.randn(2, 4),), recompute="block")


@pytest.fixture(scope="module")
def llama_half_limit():
    """A 6-layer HF Llama, its inputs, and half the memory estimate of its unconstrained auto plan: built
    and searched once for the three tests that read it (none changes the model)."""
    model, make = H.build("llama", num_hidden_layers=6)
    model.eval()
    kw = make(4, 8, 1)
    free = autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy="auto", measure_activations=False)
    return model, kw, free.choice.estimate.memory_bytes * 0.5


def test_search_recomputes_the_fewest_blocks_that_fit(llama_half_limit):
    """Catches a search that ignores recomputation (it would refuse a limit that recomputing meets) or
    recomputes more blocks than needed: at half the unconstrained estimate the chosen plan fits, it
    recomputes some but not all blocks only if fewer would not fit, it is estimated slower than the
    unconstrained one, and the compiled program recomputes exactly those blocks (fewer saved bytes,
    forward collectives repeated)."""
    model, kw, limit = llama_half_limit
    free = autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy="auto")
    pl = autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy="auto", memory_limit=limit)
    est = pl.choice.estimate
    assert est.memory_bytes <= limit and est.time_s > free.choice.estimate.time_s
    k = len(pl.choice.recompute_blocks)
    assert 0 < k <= 6 and pl.choice.recompute_blocks == tuple(f"model.layers.{i}" for i in range(k))
    trade = est.recomputed
    assert trade == pl.choice.recompute_blocks
    names = {m.name for n, m in pl.gm.named_children() if n.startswith("autopar_recompute_")}
    assert names == set(pl.choice.recompute_blocks)
    assert pl.activation_bytes < free.activation_bytes and pl.recompute_bytes > 0


def test_search_refuses_naming_the_smallest_footprint_with_recomputation(llama_half_limit):
    """Nothing fits: the error gives the smallest estimate, which recomputes every block."""
    model, kw, _ = llama_half_limit
    with pytest.raises(MemoryError, match=r"no strategy fits memory_limit=1000 B .* smallest estimate among \d+ "
                                          r"assignments is [0-9.]+ (B|KiB|MiB|GiB), recomputing all 6 repeated "
                                          r"blocks\. Use more"):
        autopar.plan(model, grid=(2, 2), example_kwargs=kw, strategy="auto", memory_limit=1000.0,
                     measure_activations=False)


def test_search_plan_with_recomputed_blocks_runs_at_parity(llama_half_limit):
    """The blocks the search chose to recompute (a subset) run on real ranks: logits, loss and every
    gradient against one process."""
    _, _, limit = llama_half_limit
    res = get_pool(4).run(H.hf_parity, "llama", over=dict(num_hidden_layers=6),
                          options={"strategy": "auto", "memory_limit": limit})
    assert_every_rank([r["excess"] for r in res], "llama auto + recompute")
    assert "regions run again in backward" in res[0]["explain"], res[0]["explain"][-600:]
    assert "blocks in backward to fit memory_limit: model.layers.0" in res[0]["explain"], res[0]["explain"][-600:]


def test_readme_figures():
    """The README's recomputation figures (tiny HF Llama, 2 layers, batch 4 x 8, 2x2) are the plan's:
    saved for backward without, with 'blocks' and with 'selective', the bytes 'blocks' receives again,
    and the step's bytes."""
    model, make = H.build("llama", num_hidden_layers=2)  # the README's model
    model.eval()
    kw = make(4, 8, 1)
    got = {m: autopar.plan(model, grid=(2, 2), example_kwargs=kw, recompute=m) for m in (None, "blocks", "selective")}
    # +4 bytes each since the loss saves its (loss, tokens, targets out of range) triple, not a pair;
    # +160 saved and -160 received since a norm's mean square is all-reduced (saved whole over the
    # columns), not reduce-scattered and gathered back
    # the default lowering='auto' runs the all-gather lowering here (q|k|v and gate|up as one group, x's
    # panel gathered and saved once): 74508 / 36096 / 66316 saved, 116876 received under 'broadcast'
    assert [got[m].activation_bytes for m in got] == [68364, 30604, 60172]
    assert got["blocks"].recompute_bytes == 29952 and got["selective"].recompute_bytes == 0
    assert {p.comm_bytes_per_rank_per_step for p in got.values()} == {98444}


def test_inspect_json_reports_recomputation(capsys):
    """`inspect --recompute blocks --json` carries the saved-for-backward bytes and the bytes received
    again; without the flag nothing is recomputed."""
    from autopar import cli

    small = ["--set", "num_hidden_layers=2", "--set", "vocab_size=256", "--batch", "2", "--seq", "8", "--json"]
    reports = {}
    for flag in ([], ["--recompute", "blocks"]):
        assert cli.main(["inspect", "llama", *small, *flag]) == 0
        reports[bool(flag)] = json.loads(capsys.readouterr().out)
    assert reports[False]["recompute_bytes_per_rank"] == 0 and reports[False]["recompute"] is None
    assert reports[True]["recompute"] == "blocks" and reports[True]["recompute_bytes_per_rank"] > 0
    assert reports[True]["activation_bytes_per_rank"] < reports[False]["activation_bytes_per_rank"]
