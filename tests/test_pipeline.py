"""Pipeline stages (parallelize(..., pipeline=...)): each stage parallelized on its own grid, run by
torch.distributed.pipelining's schedules. Parity with one process on the whole batch, every rank;
refusals."""

import pytest

from tests import checks_pipeline as C
from tests.compare import assert_every_rank
from tests.conftest import get_pool

# (grid, schedule, labels, stages per rank)
CASES = [((1, 2), "1f1b", True, 1), ((1, 2), "gpipe", False, 1),  # fast tier: 2 stages x 1x2 (4 ranks)
         ((1, 2), "looped_bfs", True, 2),
         ((1, 2), "gpipe", True, 1), ((1, 2), "1f1b", False, 1),  # slow tier
         ((1, 2), "interleaved_1f1b", True, 2), ((1, 2), "interleaved_1f1b", False, 2),
         ((1, 2), "looped_bfs", False, 2), ((1, 2), "looped_bfs", True, 1),
         ((1, 2), "interleaved_zero_bubble", True, 2), ((1, 2), "zbv_zero_bubble", True, 2),
         ((1, 2), "dualpipev", True, 2),
         ((2, 2), "1f1b", True, 1), ((2, 2), "gpipe", True, 1), ((2, 2), "looped_bfs", True, 2)]  # 8 ranks


@pytest.mark.parametrize("grid, schedule, labels, per_rank", CASES,
                         ids=[f"{'x'.join(map(str, g))}-{s}-{'labels' if lab else 'loss_fn'}-v{v}"
                              for g, s, lab, v in CASES])
def test_pipeline_stages_match_one_process(grid, schedule, labels, per_rank):
    """Catches micro-batch losses averaged without their token counts (row i of the batch ignores its
    last min(i, 6) labels), a stage boundary that loses the gradient of what it sends, a stage's parameters or
    gradients that differ from one process's, a clipped norm that leaves a stage out, and point-to-point
    sends that differ from `p2p_traffic()`."""
    m = 4 if schedule == "dualpipev" else None  # DualPipeV: at least as many micro-batches as stages
    results = get_pool(2 * grid[0] * grid[1]).run(C.parity, grid, schedule, labels=labels, per_rank=per_rank,
                                                  microbatches=m)
    for stage in (0, 1):  # each stage's ranks hold (and compare) its own parameters
        assert_every_rank([{k: v for k, v in r.items() if isinstance(v, float) and k != "held"}
                           for r in results if r["stage"] == stage],
                          f"2 stages x {grid}, {schedule}, {'labels' if labels else 'loss_fn'}, stage {stage}")
    stages = {r["stage"]: r["names"] for r in results}
    assert sorted(stages) == [0, 1], stages
    assert any(n.startswith("model.embed_tokens") for n in stages[0]), stages[0]
    last = 0 if schedule in ("zbv_zero_bubble", "dualpipev") else 1  # V placement: rank 0 holds stages 0 and 3
    assert "lm_head.weight" in stages[last] and not set(stages[0]) & set(stages[1]), stages
    world = 2 * grid[0] * grid[1]
    for rank, r in enumerate(results):  # about 1/(S*R*C) of the parameters per rank
        assert r["held"] <= 1.15 * 2 / world, (rank, r["held"])
        assert r["p2p counted"] == r["p2p planned"], (rank, r["p2p counted"], r["p2p planned"])
        assert r["explain"].startswith(f"pipeline rank {r['stage']} of 2") and "bubble" in r["explain"], r["explain"]
        if r["stage"] == 0:  # each rank sends its block of the boundary values, not all of them (hidden split)
            sent = r["p2p counted"]["fwd"][1]
            assert 0 < sent < r["whole sent"] * per_rank, (rank, r["p2p counted"], r["whole sent"])
        if per_rank == 1:  # stage 0 sends its outputs forward, stage 1 their gradients backward
            sending = "fwd" if r["stage"] == 0 else "bwd"
            assert f"{sending} " in r["explain"], r["explain"]
            assert r["p2p counted"][{"fwd": "bwd", "bwd": "fwd"}[sending]] == (0, 0), r


def test_pipeline_refusals(pool4):
    """A batch the micro-batches do not divide, a split point that is not a module path (the error lists
    the repeated blocks), replicas with a pipeline, a world of the wrong size, a schedule not built, a
    forward call (names train_step), generate, a train_step without the labels the pipeline was built
    with, and an embedding tied to the LM head across the stages: each a clear error on every rank."""
    for r in pool4.run(C.refusals):
        assert "cannot be cut into 3 micro-batches" in r["microbatches"], r["microbatches"]
        assert "'model.layer.1'" in r["split point"] and "model.layers.0" in r["split point"], r["split point"]
        assert "not built" in r["replicas"], r["replicas"]
        assert "needs 8 processes" in r["world"], r["world"]
        assert "'chimera'" in r["schedule"] and "looped_bfs" in r["schedule"], r["schedule"]
        assert "stages_per_rank=2" in r["per rank"] and "interleaved_1f1b" in r["per rank"], r["per rank"]
        assert "expected 2" in r["v per rank"], r["v per rank"]
        assert "train_step" in r["forward"], r["forward"]
        assert "generate" in r["generate"], r["generate"]
        assert "pass labels=" in r["no labels"], r["no labels"]
        assert "tied across stages are not built" in r["tied"], r["tied"]
