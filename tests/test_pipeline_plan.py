"""autopar.plan(..., pipeline=...) on one process: the bubble of each schedule family, the stages a
pipeline rank holds, the cluster presets' choice of link per axis, and bad requests."""

import warnings

import pytest

import autopar
from passes.cost.cluster import PRESETS, resolve_cluster
from passes.cost.pipeline import bubble, in_flight
from tests import checks_pipeline as C


def test_bubble_and_in_flight_follow_the_schedules():
    """GPipe and 1F1B idle (S-1)/(M+S-1) of the step; interleaved stages divide the fill by V; the
    zero-bubble family a third of it. GPipe keeps all M micro-batches, 1F1B at most S - rank."""
    assert bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble("1f1b", 4, 8) == bubble("gpipe", 4, 8)
    assert bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble("looped_bfs", 4, 8, 2) == bubble("interleaved_1f1b", 4, 8, 2)
    assert bubble("zbv_zero_bubble", 4, 8, 2) == pytest.approx(1 / 17)
    assert [in_flight("1f1b", 4, 8, 1, p) for p in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 8) == 8 and in_flight("1f1b", 4, 2) == 2


def test_cluster_prices_axes_that_span_nodes_with_the_slower_link():
    """Nodes of 8: a 2x4 grid stays in a node (NVLink on both axes), an 8x8 grid's rows span 8 nodes
    (InfiniBand on axis 0); the pipeline axis of 2 stages of a 2x4 grid spans 16 ranks (InfiniBand)."""
    h100 = resolve_cluster("dgx-h100")
    small, big = h100.cost_model(1, 1, 2, 4), h100.cost_model(1, 1, 8, 8)
    assert small.beta == (h100.intra.beta_bytes_per_s,) * 2
    assert big.beta == (h100.inter.beta_bytes_per_s, h100.intra.beta_bytes_per_s)
    assert h100.axis_link("pp", 2, 1, 2, 4) == h100.inter and h100.axis_link("pp", 2, 1, 1, 4) == h100.intra
    assert set(PRESETS) >= {"dgx-h100", "dgx-a100"}
    with pytest.raises(autopar.UsageError, match="dgx-h100"):
        resolve_cluster("dgx-h1000")


def test_plan_of_a_pipeline_per_stage_and_rank():
    """Two pipeline ranks of two looped stages each: every stage planned (one layer each), rank 0 holds
    stages 0 and 2, the step estimate exceeds M times the slowest rank's work by the bubble, and
    memory counts the micro-batches in flight."""
    model, make = C._llama(4)
    batch = make(8, 8, 1)
    pipe = autopar.Pipeline(stages=2, schedule="looped_bfs", stages_per_rank=2, microbatches=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = autopar.plan(model, grid=(1, 2), example_kwargs=batch, pipeline=pipe, cluster="dgx-h100")
    assert [s.index for s in pl.stages] == [0, 1, 2, 3]
    assert [s.layers for s in pl.stages] == [[f"model.layers.{i}"] for i in range(4)]
    assert [r["stages"] for r in pl.ranks] == [[0, 2], [1, 3]]
    assert pl.bubble == pytest.approx(1 / 9)
    slowest = max(r["work_s"] for r in pl.ranks)
    assert pl.step_s == pytest.approx(4 * slowest / (1 - pl.bubble))
    assert all(r["memory_bytes"] > sum(pl.stages[j].state_bytes for j in r["stages"]) for r in pl.ranks)
    assert pl.stages[-1].send_fwd_bytes == 0 and pl.stages[0].send_bwd_bytes == 0
    assert "pipeline rank 1: stages [1, 3]" in str(pl) and pl.to_json()["schedule"] == "looped_bfs"
    with pytest.raises(autopar.UsageError, match="pipeline="):
        autopar.plan(model, grid=(1, 2), example_kwargs=batch, pipeline="two")


@pytest.mark.parametrize("recompute", [(False,), (False, "blocks")], ids=["plain", "recompute"])
def test_choose_pipeline_picks_the_fastest_layout_that_fits(recompute):
    """16 devices, an 8-layer Llama, a batch of 16 rows: every (S, R, C, d, schedule, replica mode) tried
    is a row (with and without recomputing the blocks); the choice is the fastest that fits, no row that
    fits is faster, and a limit nothing fits under is refused by name."""
    model, make = C._llama(8)  # 4 blocks per stage: the estimate prices recomputation on 4 or more alike
    batch = make(16, 8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best, table = autopar.choose_pipeline(model, 16, batch, stages=[2], grids=[(2, 2)],
                                              schedules=("1f1b", "gpipe"), recompute=recompute)
    assert {(r["stages"], r["grid"], r["d"], r["schedule"], r["data_parallel"], r["recompute"]) for r in table} == {
        (2, (2, 2), 2, sched, mode, again) for sched in ("1f1b", "gpipe") for mode in ("replicate", "shard")
        for again in recompute}
    for row in (r for r in table if r["recompute"] == "blocks"):  # recomputing every block holds less, takes longer
        twin = next(r for r in table if r["recompute"] is False and all(
            r[k] == row[k] for k in ("grid", "schedule", "data_parallel")))
        assert row["memory_bytes"] < twin["memory_bytes"] and row["step_s"] > twin["step_s"], (row, twin)
    assert all(r["stages"] * r["d"] * r["grid"][0] * r["grid"][1] == 16 for r in table)
    fitting = [r for r in table if r["fits"]]
    assert best.step_s == min(r["step_s"] for r in fitting)
    assert best.pipeline.n_microbatches * best.grid[0] == 16
    with pytest.raises(autopar.MemoryLimitError, match="no pipeline layout of 16 devices fits"):
        autopar.choose_pipeline(model, 16, batch, stages=[2], grids=[(2, 2)], memory_limit=1024, recompute=(False,))


def test_choose_pipeline_returns_only_what_parallelize_runs():
    """Catches plans that cannot run (issue 50, item 5): with 2 rows per replica in micro-batches of 2
    rows, 1F1B would get 1 micro-batch for 2 stages, which torch refuses; the search skips it and says
    so when nothing else is left, and every row it returns builds a Pipeline (the same check
    parallelize makes). For 7 devices no stage count divides: a UsageError says that and names
    choose_grid, not a MemoryLimitError with '0 tried'."""
    model, make = C._llama(2)
    batch = make(4, 8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best, table = autopar.choose_pipeline(model, 4, batch, stages=[2], grids=[(1, 1)], microbatch_rows=2,
                                              schedules=("1f1b", "gpipe"), recompute=(False,))
        for row in table:  # each a Pipeline that parallelize accepts
            autopar.Pipeline(stages=row["stages"], schedule=row["schedule"], microbatches=row["microbatches"],
                             stages_per_rank=row["stages_per_rank"])
        assert {r["schedule"] for r in table} == {"gpipe"} and best.pipeline.schedule == "gpipe", table
        with pytest.raises(autopar.UsageError, match=r"no layout of 4 devices.*1F1B needs microbatches >= stages"):
            autopar.choose_pipeline(model, 4, batch, stages=[2], grids=[(1, 1)], schedules=("1f1b",),
                                    microbatch_rows=2, recompute=(False,))
        with pytest.raises(autopar.UsageError, match=r"no stage count from 2 to 16 divides 7.*choose_grid"):
            autopar.choose_pipeline(model, 7, batch)
    with pytest.raises(autopar.UsageError, match=r"1F1B needs microbatches >= stages \(1 < 2\)"):
        autopar.Pipeline(stages=2, microbatches=1)
    assert autopar.Pipeline(stages=2, schedule="dualpipev", stages_per_rank=2).n_microbatches == 4
