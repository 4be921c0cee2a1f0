"""Planning without the hardware: the plan equals what parallelize runs, its bytes equal a real run's,
its memory accounting at 8x8 adds up, and the CLI reports it."""

import json
import os
import subprocess
import sys

import pytest
import torch

import autopar
from tests import checks_plan as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["mlp", "attention", "gpt2", "bench llama", "mixtral", "peft llama"])
def test_plan_equals_a_real_2x2_run(pool4, name):
    """Catches a planner that drifts from the engine: a different rewritten graph, or bytes (or
    collective calls) that the collective layer does not actually move (launch); a frozen weight (peft's
    base layers) priced with a weight gradient it never gets (132.0 KiB charged, 12,288 B moved). The MoE token
    dispatch's bytes depend on the routing and are left out here (planned for balanced routing;
    tests/test_moe.py checks the counted ones against the router's choices)."""
    for rank, r in enumerate(pool4.run(C.plan_vs_run, name)):
        assert r["same code"], f"rank {rank}: plan and parallelize built different graphs"
        assert (r["routing"] > 0) == (name == "mixtral"), f"rank {rank}: routing bytes planned {r['routing']}"
        assert r["planned"] == r["counted"], f"rank {rank}: planned {r['planned']} B, counted {r['counted']} B"
        assert r["planned calls"] == r["counted calls"], \
            f"rank {rank}: planned {r['planned calls']} collective calls (fwd, bwd), launched {r['counted calls']}"


def test_1d_is_sequence_parallel_in_both_directions(pool4):
    """strategy='1d' at 1x4 on the benchmark Llama is Megatron's sequence parallelism: the residual
    stream stays split over the sequence, each row-split product's partial sum is reduce-scattered
    onto it and each column-split product's input all-gathered from it, and backward mirrors both.
    Catches the gather's backward as an all-reduce of the whole gradient and a cut of the rank's
    block (twice the bytes of the reduce-scatter; what autopar ran before); planned bytes and calls
    equal those a real step counts on every rank (loss and gradients: test_engine_parity, 1x4 1d)."""
    for rank, r in enumerate(pool4.run(C.plan_vs_run, "bench llama", (1, 4), "1d")):
        assert r["same code"], f"rank {rank}: plan and parallelize built different graphs"
        assert r["planned"] == r["counted"], f"rank {rank}: planned {r['planned']} B, counted {r['counted']} B"
        assert r["planned calls"] == r["counted calls"], (rank, r["planned calls"], r["counted calls"])
        gathers = [row for row in r["rows"] if "all-gather(axis 1" in row[1] and row[0].startswith("Redistribute")]
        scatters = [row for row in r["rows"] if row[1].startswith("reduce-scatter(axis 1)")]
        # the 4 layers' 2 norms and the final norm each reduce-scatter; q|k|v, gate|up and the head gather
        assert (len(gathers), len(scatters)) == (9, 9), (rank, len(gathers), len(scatters))
        for op, what, fwd, bwd in gathers + scatters:
            assert fwd == bwd > 0, (rank, op, what, fwd, bwd)  # backward moves what forward moved
        assert all("bwd reduce-scatter" in what for _, what, _, _ in gathers), (rank, gathers)
        synced = [row for row in r["rows"] if row[0].startswith("GradSync") and row[3] > 2**16]
        assert not synced, f"rank {rank}: activation gradients still all-reduced: {synced}"


def test_plan_8x8_on_one_process():
    """A Llama-shaped model planned at 8x8 in this process (fake tensors, a fake process group): every
    weight q divides holds exactly 1/64, the rest is listed, and the total adds up."""
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=1024)
    with autopar.meta_init():
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(8, 64, dtype=torch.long)
    pl = autopar.plan(model, grid=(8, 8), example_kwargs=dict(input_ids=ids, labels=ids))
    listed = pl.params_above_1_over_p
    for name, v in pl.params.items():
        if name not in listed:
            assert v.bytes_per_rank * 64 == v.bytes_total, name
    excess = sum(mine - pl.params[n].bytes_total / 64 for n, mine in listed.items())
    assert pl.param_bytes_per_rank <= 1.05 * pl.param_bytes_total / 64 + excess
    assert all(len(pl.params[n].shape) == 1 for n in listed), listed  # only norm weights stay 1/q
    j = pl.to_json()
    assert j["activation_bytes_per_rank"] > 0 and j["largest_tensor_bytes"] > 0
    assert not [f for f in j["fallback_nodes"] if f["costly"]]


def _cli(*args):
    """`python -m autopar inspect ...` in a real subprocess: the command as a user runs it."""
    return subprocess.run([sys.executable, "-m", "autopar", "inspect", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _inspect(capsys, *args):
    """`autopar inspect ...` through cli.main in this process (torch and transformers already loaded:
    a subprocess costs seconds of imports each); the same exit code, stdout and stderr text."""
    from autopar import cli

    capsys.readouterr()
    try:
        code = cli.main(["inspect", *args])
    except SystemExit as e:  # as the interpreter does: a message goes to stderr with exit status 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["autopar", "inspect", *args], code, out, err)


def test_cli_json():
    r = _cli("llama", "--grid", "2x2", "--batch", "2", "--seq", "16", "--set", "num_hidden_layers=1",
             "--set", "hidden_size=64", "--set", "intermediate_size=128", "--set", "num_attention_heads=4",
             "--set", "num_key_value_heads=4", "--set", "vocab_size=256", "--vs", "1d", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("comm_bytes_per_rank_per_step", "param_bytes_per_rank", "activation_bytes_per_rank",
                "fallback_nodes", "grid", "vs_1d"):
        assert key in out, key
    assert out["grid"] == [2, 2] and out["comm_bytes_per_rank_per_step"] > 0


def test_cli_bad_set_key(capsys):
    r = _inspect(capsys, "gpt2", "--grid", "2x2", "--set", "n_layerz=2")
    assert r.returncode != 0
    assert "GPT2Config has no key(s) ['n_layerz']" in r.stderr and "n_layer" in r.stderr


def test_cli_grid_auto_and_strategy(capsys):
    """`inspect --grid auto --devices 4` searches every arrangement of 4 ranks (grids and replicas of a
    grid) and plans the fastest with strategy auto; the JSON carries the search table and the choice."""
    small = ["--batch", "4", "--seq", "16", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
             "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
             "--set", "vocab_size=256"]
    r = _inspect(capsys, "llama", "--grid", "auto", "--devices", "4", *small, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    shapes = [tuple(row["grid"]) for row in out["grid_search"]]
    assert shapes == [(1, 4), (2, 2), (4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]  # grids, then replicas of a grid
    best = min((row for row in out["grid_search"] if row["searched"]), key=lambda row: row["auto_s"])
    assert best["picked"] and out["grid"] == list(best["grid"][-2:])
    assert best["auto_s"] <= min(t for row in out["grid_search"] for t in row["fixed_s"].values())
    if tuple(best["grid"][-2:]) == (1, 1):  # replicas of one rank (this tiny model's pick): nothing to split
        assert "strategy_auto" not in out
    else:
        auto = out["strategy_auto"]
        assert auto["estimated_step_s"] <= min(auto["fixed_2d_step_s"], auto["fixed_1d_step_s"])
    r = _inspect(capsys, "llama", "--grid", "auto", *small)
    assert r.returncode != 0 and "--grid auto needs --devices N" in r.stderr
    r = _inspect(capsys, "llama", "--grid", "2x2", "--strategy", "auto", *small)
    assert r.returncode == 0, r.stderr
    assert "strategy auto: estimated step" in r.stdout and "[auto: " not in r.stdout  # table by module


def test_frozen_parameters_hold_no_gradient_or_optimizer_state():
    """peft's frozen base layers were priced as trained: gradients and AdamW states of every parameter.
    Only the LoRA matrices (requires_grad) get them now, in the plan's memory and in the search's."""
    model, args, kwargs = C.MODELS["peft llama"]()
    pl = autopar.plan(model, grid=(2, 2), example_inputs=args, example_kwargs=kwargs)
    lora = sum(v.bytes_per_rank for n, v in pl.params.items() if ".lora_" in n)
    j = pl.to_json()
    assert 0 < lora < pl.param_bytes_per_rank
    assert (j["grad_bytes_per_rank"], j["adamw_state_bytes_per_rank"]) == (lora, 2 * lora), j
    auto = autopar.plan(model, grid=(2, 2), example_inputs=args, example_kwargs=kwargs, strategy="auto")
    est = auto.choice.estimate
    assert est.frozen_param_bytes == est.param_bytes - sum(
        v.bytes_per_rank for n, v in auto.params.items() if ".lora_" in n), (est.param_bytes, est.frozen_param_bytes)


def test_norm_statistics_take_one_call_each_way():
    """transformers' RMSNorm written out (pow, mean, rsqrt) at 2x2: the mean square is a partial sum
    over the columns; it was reduce-scattered onto the sequence and the rsqrt gathered back (two
    calls each way per norm, for the bytes of one all-reduce). A per-token statistic is now
    all-reduced: one call forward, one backward, per norm, plus its weight's gradient sum."""
    model, kwargs = C.meta_llama(layers=3)
    pl = autopar.plan(model, grid=(2, 2), example_kwargs=kwargs, measure_activations=False)
    for layer in (1, 2):  # layer 0's first norm also reduce-scatters the embedding's partial sum
        for norm in ("input_layernorm", "post_attention_layernorm"):
            module = f"model.layers.{layer}.{norm}"
            rows = [r for r in pl.rows if r.module == module and (r.calls_fwd or r.calls_bwd)]
            calls = (sum(r.calls_fwd for r in rows), sum(r.calls_bwd for r in rows))
            assert calls == (1, 2), (module, calls, [(r.op, r.collectives) for r in rows])


def test_each_product_takes_the_lowering_its_estimate_prices_faster():
    """lowering='auto' (the default): each SUMMA product runs the lowering the cost model prices faster.
    With the default model's alpha per launch that is the all-gather lowering at 2x2 (the broadcast
    lowering launched 12 calls per product and step, 2.6x the calls); with launches free and slow
    matmuls, the broadcast lowering that overlaps its transfers with the matmuls. A fixed lowering is
    kept under strategy='auto' too (the search used to override it per product)."""
    from passes.cost.model import CostModel

    model, kwargs = C.meta_llama(layers=2)
    kw = dict(example_kwargs=kwargs, measure_activations=False)

    def lowerings(pl):
        return sorted({m.lowering for m in pl.gm.modules() if type(m).__name__ == "SummaLinear"})

    default, bcast, gather = (autopar.plan(model, grid=(2, 2), **kw, **extra)
                              for extra in ({}, dict(lowering="broadcast"), dict(lowering="allgather")))
    assert lowerings(default) == ["allgather"] and default.gm.code == gather.gm.code, lowerings(default)
    assert default.collectives_per_rank_per_step * 2 < bcast.collectives_per_rank_per_step, (
        default.collectives_per_rank_per_step, bcast.collectives_per_rank_per_step)
    assert default.comm_bytes_per_rank_per_step <= bcast.comm_bytes_per_rank_per_step
    free_launches = CostModel(alpha=(0.0, 0.0), beta=(1e12, 1e12), flops=1e6)
    overlapped = autopar.plan(model, grid=(2, 2), cost_model=free_launches, **kw)
    assert lowerings(overlapped) == ["broadcast"] and overlapped.gm.code == bcast.gm.code, lowerings(overlapped)
    searched = autopar.plan(model, grid=(2, 2), strategy="auto", lowering="broadcast", **kw)
    assert lowerings(searched) in ([], ["broadcast"]), lowerings(searched)
    assert set(searched.choice.lowerings.values()) <= {"broadcast"}, searched.choice.lowerings
