"""`autopar bench`'s report: the compiled rows are set against their eager twins (no timing asserted)."""

from autopar.bench.compare import COMPILED, markdown

ROW = dict(bytes=2**20, param_bytes=2**20, saved_bytes=2**20, peak_rss_mb=1.0, peak_tensor_bytes=2**20)


def test_compiled_rows_report_the_ratio_to_eager():
    """Catches a compiled row set against the wrong eager row, or one left out of the report."""
    res = {"PyTorch 1D TP (4 ranks)": dict(ROW, step_s=0.4),
           "2D 2x2 broadcast": dict(ROW, step_s=0.5, input_check_s=0.002),
           "2D 2x2 broadcast" + COMPILED: dict(ROW, step_s=0.4),
           "PyTorch 1D TP (4 ranks)" + COMPILED: dict(ROW, step_s=0.3)}
    overhead = {"eager": 0.2, "autopar 1x1": 0.21, "autopar 1x1" + COMPILED: 0.15}
    text = markdown(res, overhead)
    assert "- 2D 2x2 broadcast: 400 ms compiled, 500 ms eager, ratio 0.80" in text, text
    assert "- PyTorch 1D TP (4 ranks): 300 ms compiled, 400 ms eager, ratio 0.75" in text, text
    assert "- autopar 1x1: 150 ms compiled, 210 ms eager, ratio 0.71" in text, text
    # the default input check's cost, set against the step it precedes
    assert "input check (check_inputs=True, the default; every call): 2.00 ms, 0.40% of the 2D 2x2" in text, text


def test_no_compiled_rows_without_compile():
    res = {"PyTorch 1D TP (4 ranks)": dict(ROW, step_s=0.4)}
    assert "torch.compile" not in markdown(res, {"eager": 0.2, "autopar 1x1": 0.21})


def test_moe_report_sets_losses_against_one_process():
    """`autopar bench --moe`'s table. Catches a configuration whose losses drift from one process's
    reported as matching, params x 1/p computed against the wrong total, or a row left out."""
    from autopar.bench.moe import ONE, TORCH_TP, markdown

    row = dict(step_s=0.25, bytes=3 * 2**20, param_bytes=2**20, total_param_bytes=2**22)
    res = {ONE: dict(row, bytes=0, param_bytes=2**22, losses=[8.0, 7.5]),
           "autopar 2x2": dict(row, losses=[8.0, 7.5 * (1 + 5e-5)]),
           TORCH_TP: dict(row, param_bytes=2**21, losses=[8.0, 7.5 * (1 + 2e-3)])}
    lines = markdown(res).splitlines()
    assert lines[2] == "| one process | 250 ms | 0.0 MiB | 4.0 MiB | 4.00 | - |", lines
    assert lines[3] == "| autopar 2x2 | 250 ms | 3.0 MiB | 1.0 MiB | 1.00 | match (5.0e-05) |", lines
    assert lines[4].endswith("| 2.0 MiB | 2.00 | MISMATCH (2.0e-03) |"), lines


def test_moe_bench_pytorch_baseline_matches_one_process(pool4):
    """The PyTorch row of `autopar bench --moe` (DTensor 1D TP, experts split by
    ExpertIntermediateParallel) on a tiny Mixtral. Catches gate and up blocks that do not match on a
    rank, a token or routing-weight gradient left as one rank's share, or a sum counted twice."""
    from tests.checks_moe import torch_tp_parity
    from tests.compare import assert_every_rank

    per_rank = pool4.run(torch_tp_parity)
    assert_every_rank([r["errs"] for r in per_rank], "PyTorch 1D TP + expert TP, tiny mixtral")
    assert any(n.endswith("experts.gate_up_proj") for n in per_rank[0]["errs"]), per_rank[0]["errs"]


def test_bench_torchtitan_baseline_matches_one_process(pool4):
    """The PyTorch 1D TP+SP row of `autopar bench` (torchtitan's plan: sequence parallelism, loss over
    vocabulary blocks) on a tiny Llama against one process. Catches a baseline that runs but computes
    another loss: a residual left as one rank's sequence block, a mask built for the local sequence.

    Beside it, autopar's 2D at 2x2 with default options on the same model and batch: it must launch at
    most twice the baseline's collective calls (the broadcast lowering launched 3.3x: 12 calls per
    weight product and step at q=2), exactly the calls its plan counts, and match one process."""
    from tests import checks_foreign
    from tests.compare import assert_every_rank

    per_rank = pool4.run(checks_foreign.bench_tp_sp_parity)
    assert_every_rank([r["errs"] for r in per_rank], "PyTorch 1D TP+SP, tiny llama")
    assert "model.layers.1.mlp.down_proj.weight" in per_rank[0]["names"], per_rank[0]["names"]
    assert_every_rank([r["2d errs"] for r in per_rank], "autopar 2D 2x2, default lowering, tiny llama")
    for rank, r in enumerate(per_rank):
        assert r["2d calls"] == r["2d planned calls"], (rank, r["2d calls"], r["2d planned calls"])
        assert r["2d calls"] <= 2 * r["tp_sp calls"], (rank, r["2d calls"], r["tp_sp calls"], r["2d lowerings"])


def test_lowering_benchmark_counts_what_is_alive_at_once():
    """`autopar bench --lowerings` reads a product's temporary memory from the storages its ops create:
    two 4 KiB tensors alive together, then one freed before a third: an 8 KiB peak. Views and in-place
    ops of an input add nothing."""
    import torch

    from autopar.bench.lowerings import LiveAllocations

    x = torch.zeros(1024)
    track = LiveAllocations()
    with track:
        a = x + 1  # 4 KiB
        b = a * 2  # 4 KiB: 8 alive
        del a
        c = b.narrow(0, 0, 512).add_(1)  # a view of b, in place: nothing new
        d = b - 1  # 4 KiB: 8 alive again
    assert track.peak == 8192, track.peak
    assert c.numel() == 512 and d.numel() == 1024


def test_overlap_benchmark_runs_both_settings_alike():
    """examples/bench_overlap.py (`make bench-overlap`) end to end on one configuration, one step each:
    catches the script rotting, and an `overlap` switch that changes a byte, a call or a gradient bit
    (both settings must move the same traffic and give identical gradients on the same batch)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "examples/bench_overlap.py", "--steps", "1", "--json", "--configs", "2D 2x2 broadcast"]
    proc = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert list(res) == ["2D 2x2 broadcast"], res
    row = res["2D 2x2 broadcast"]
    assert row["same_traffic"] and row["same_grads"] and row["calls"] > 0, row
    assert all(row[k] > 0 for k in ("step_s_on", "step_s_off", "exposed_s_on", "exposed_s_off")), row
