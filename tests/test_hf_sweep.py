"""A fast subset of the transformers sweep (examples/sweep_hf.py; `make sweep-hf` runs all of it).

Each family runs the sweep's own rank-side check on a 2x2 grid: every output tensor, the losses and
every parameter gradient against the unmodified model on one process, element-wise on every rank.
The families are chosen for mechanisms that tests/test_hf.py does not cover. The reporting and the
command line of the runner are tested on plain data.
"""

import pytest

import hf_families
import sweep_hf
from tests.compare import assert_every_rank

FAST = {
    "bloom": "ALiBi position bias added to baddbmm scores, LayerNorm on the embeddings",
    "gpt_neox": "q/k/v fused and interleaved per head in one projection, partial rotary, untied head",
    "falcon": "multi-query attention: one K/V head inside a fused projection, parallel attention + MLP",
    "mixtral": "MoE: top-2 routing, experts split over the grid (P(rows) results), router load-balancing loss",
    "bart": "encoder-decoder with learned offset positions, cross-attention, final_logits_bias buffer",
    "albert": "one layer's weights shared by both layers (gradients summed over uses), factorized embedding",
    "xlm_roberta_xl": "a token-type table of one row split over 2 mesh rows: the second row's block is empty",
    "convnext": "depthwise 7x7 convolutions: channels over the columns in whole groups, nothing gathered",
}
NOTHING_GATHERED = {"convnext"}  # families whose every op has a rule: a fallback there is a regression


@pytest.mark.parametrize("family", FAST)
def test_sweep_family_parity(pool4, family):
    """Catches a family that breaks in capture, planning or numerics: a wrong split of a fused or
    multi-query projection, a position bias computed on the wrong block, a shared weight whose
    gradient misses one use, a MoE fallback that re-splits wrongly -- on any rank, any element."""
    per_rank = pool4.run(sweep_hf.family_parity, family)
    errors = {rank: f"{r['stage']}: {r['error']}" for rank, r in enumerate(per_rank) if r["error"]}
    assert not errors, f"{family} ({FAST[family]}): {errors}"
    assert_every_rank([r["errs"] for r in per_rank], family)
    if family in NOTHING_GATHERED:
        assert all(not r["gathered"] for r in per_rank), [r["gathered"] for r in per_rank]
    names = set(per_rank[0]["errs"])
    assert any(n.startswith("grad ") for n in names) and "output loss" in names and "output logits" in names


def _rank(errs=None, error=None, refused=False, held=100, gathered=()):
    return {"errs": errs or {}, "error": error, "refused": refused, "stage": "parallelize", "gathered": list(gathered),
            "free": 1, "warnings": 0, "held": held, "total": 400}


def test_report_names_the_worst_tensor_on_any_rank():
    """Catches a report that looks only at rank 0, or names the wrong tensor or rank."""
    per_rank = [_rank({"output logits": 0.2, "grad w": 0.5}), _rank({"output logits": 0.2, "grad w": 3.0}, held=130),
                _rank({"output logits": 0.2, "grad w": 0.5}), _rank({"output logits": 1.5, "grad w": 0.5})]
    row = sweep_hf.summarize("gpt2", (2, 2), "2d", per_rank)
    assert row.status == "MISMATCH"
    assert row.reason.startswith("worst grad w on rank 1: excess 3"), row.reason
    assert "2 tensor(s) off on 2 rank(s)" in row.reason, row.reason
    assert row.worst == 3.0 and row.fraction == pytest.approx(1.3)


def test_report_errors_refusals_and_fallbacks():
    """Catches an exception on one rank reported as a match, a refusal reported as a crash, and
    gathered fallbacks left out of a matching row."""
    ok = _rank({"grad w": 0.1})
    row = sweep_hf.summarize("t5", (2, 2), "2d", [ok, ok, _rank(error="ValueError: bad"), ok])
    assert (row.status, row.reason) == ("error", "parallelize (rank 2): ValueError: bad")
    row = sweep_hf.summarize("t5", (2, 2), "2d", [_rank(error="ShardingError: no", refused=True)] * 4)
    assert row.status == "refused"
    row = sweep_hf.summarize("mixtral", (2, 2), "2d", [_rank({"grad w": 0.1}, gathered=["topk", "topk", "index"])] * 4)
    assert (row.status, row.reason, row.gathered, row.free) == ("match", "gathered whole: topk x2, index x1", 3, 1)
    assert "| mixtral | moe | 2x2 | 2d | match | 0.1 | 3 / 1 | 1.00 |" in sweep_hf.table([row])


def test_cli_rejects_unknown_family_and_bad_grid(capsys):
    """Catches a typo in --families silently sweeping nothing, or a --grid that is misread."""
    with pytest.raises(SystemExit):
        sweep_hf.parse(["--families", "gpt2,gtp2"])
    assert "--families: unknown ['gtp2']; expected names from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep_hf.parse(["--grid", "2by2"])
    assert "--grid '2by2': expected RxC, e.g. 2x2 or 1x4" in capsys.readouterr().err
    _, runs = sweep_hf.parse(["--families", "bloom", "--grid", "1x4", "--strategy", "auto"])
    assert runs == [("bloom", (1, 4), "auto")]
    _, runs = sweep_hf.parse([])
    assert len(runs) == len(hf_families.FAMILIES) + len(sweep_hf.EXTRAS)


def test_registry_refuses_unknown_family():
    """Catches a misspelled family building some default model instead of failing."""
    with pytest.raises(ValueError, match="unknown family 'gtp2': expected one of .*gpt2"):
        hf_families.build("gtp2")


def test_pool_start_is_retried_then_refused(capsys):
    """Catches a pool that failed to start (a port another process took) being blamed on the next
    family, and a start that fails every time looping forever instead of saying so."""
    starts = []

    class Flaky:  # the first start loses its port, the second works
        def __init__(self, world):
            starts.append(world)

        def run(self, fn, timeout):
            if len(starts) == 1:
                raise AssertionError("ready: rank(s) [0] died")
            return [fn(r) for r in range(4)]

    assert isinstance(sweep_hf._start_pool(Flaky, 4, sweep_hf.ready), Flaky) and starts == [4, 4]
    out = capsys.readouterr().out
    assert "pool of 4 ranks failed to start (AssertionError: ready: rank(s) [0] died); retrying" in out

    class Dead(Flaky):
        def run(self, fn, timeout):
            raise AssertionError("ready: rank(s) [2] died")

    with pytest.raises(RuntimeError, match=r"could not start 4 gloo ranks in 3 tries; see the errors above"):
        sweep_hf._start_pool(Dead, 4, sweep_hf.ready)
