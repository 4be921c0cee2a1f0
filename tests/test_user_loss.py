"""The user's own loss on a ParallelModule's outputs, and output dtypes under autocast, on 2x2 and 1x4.

Parity against the unmodified model on one process, on every rank: the loss and every parameter
gradient (fp32: rtol 1e-4 plus 1e-5 x the largest reference value of the group, tests/compare.py;
bf16 under autocast: rtol 2e-2 plus 2e-2 x the largest reference value). Bytes: what the loss moved per
rank under CommLog's conventions; DTensor's own collectives are listed and must not gather the logits.
"""

import pytest
import torch

from tests import checks_user_loss as C
from tests.compare import assert_every_rank

GRIDS = [(2, 2), (1, 4)]
N_TOKENS, VOCAB = 32, 64  # 4 x 8 tokens of the tiny models' calls, their vocabulary


def _kernel_bytes(grid, n=N_TOKENS):
    """CommLog bytes of the vocab-parallel cross-entropy on [n, vocab] fp32 logits: all-reduce of the
    row max [n/R] and of (Σexp, target logit) [2, n/R] over the C columns, of (sum, count, targets out
    of range) over the R rows."""
    rows, cols = grid
    ring = lambda q, nbytes: 2 * (q - 1) * nbytes // q  # noqa: E731
    return ring(cols, 4 * n // rows) + ring(cols, 8 * n // rows) + ring(rows, 12)


def _row_gather_bytes(grid, n=N_TOKENS, vocab=VOCAB):
    """What DTensor's cross-entropy moves: each rank gathers the vocabulary of its [n/R, V/C] fp32 block
    from the other C-1 columns (on a 1 x C grid that is the whole logits)."""
    rows, cols = grid
    return (cols - 1) * (n // rows) * (vocab // cols) * 4


@pytest.mark.parametrize("grid", GRIDS)
def test_cross_entropy_on_hf_logits(pool4, grid):
    """Catches: DTensor's "mixed torch.Tensor and DTensor" error on plain labels; a gather of the logits
    for the loss; a mean of per-block means (wrong when row blocks count different numbers of tokens
    not ignored); reduction='sum'; the shifted and nn.CrossEntropyLoss forms; the forms DTensor computes
    (class weights, label smoothing, reduction='none')."""
    res = pool4.run(C.ce_on_hf_logits, grid)
    assert_every_rank([r["excess"] for r in res], f"cross_entropy on llama logits, grid {grid}")
    for rank, r in enumerate(res):
        facts = r["facts"]
        assert all(f["plain"] for tag, f in facts.items() if tag != "none"), (rank, facts)  # none: user's .sum()
        assert facts["mean"]["output_type"] == "Output", facts["mean"]
        for tag in ("mean", "sum", "shifted", "float mean"):
            assert facts[tag]["dtensor_collectives"] == [], (rank, tag, facts[tag])
        assert facts["mean"]["bytes"] == facts["sum"]["bytes"] == _kernel_bytes(grid), (rank, facts["mean"])
        assert facts["shifted"]["bytes"] == _kernel_bytes(grid, n=28), (rank, facts["shifted"])
        for tag in ("weighted mean", "smoothed mean", "none"):  # DTensor's path: the vocabulary, within a row
            assert facts[tag]["dtensor_collectives"] == [("all_gather_single", _row_gather_bytes(grid))], facts[tag]
        assert "target 64 is outside the 64 classes" in r["bad_target"], r["bad_target"]
    print({tag: (f["bytes"], f["dtensor_collectives"]) for tag, f in res[0]["facts"].items()})


@pytest.mark.parametrize("grid", GRIDS)
def test_elementwise_losses_on_repo_model(pool4, grid):
    """Catches: mse/l1/smooth_l1 of an output against a plain target failing, gathering the output, or
    averaging block means; the reduced loss must come back a plain tensor (one all-reduce of a scalar)."""
    res = pool4.run(C.mse_on_repo_model, grid)
    assert_every_rank([r["excess"] for r in res], f"elementwise losses on TinyGPT, grid {grid}")
    for rank, r in enumerate(res):
        for tag, f in r["facts"].items():
            assert f["plain"] and f["dtensor_collectives"] == [], (rank, tag, f)
            assert f["bytes"] <= 8, (rank, tag, f)  # all-reduces of one fp32 number
    print({tag: f["bytes"] for tag, f in res[0]["facts"].items()})


@pytest.mark.parametrize("grid", GRIDS)
def test_autocast_dtypes_match_one_process(pool4, grid):
    """Catches outputs whose dtype differs from the single process under autocast (fp32 logits where one
    process returns bf16, or the reverse), and bf16 values or gradients that drift."""
    res = pool4.run(C.autocast_dtypes, grid)
    assert_every_rank([r["excess"] for r in res], f"autocast bf16 llama, grid {grid}")
    for rank, r in enumerate(res):
        assert r["dtypes"]["got"] == r["dtypes"]["want"], (rank, r["dtypes"])
        assert r["dtypes"]["got"]["logits"] == torch.bfloat16, r["dtypes"]
        assert r["dtypes"]["same"] == (r["dtypes"]["want"]["logits"], r["dtypes"]["want"]["loss"]), r["dtypes"]
        assert r["dtypes"]["own"] == (torch.float32, torch.float32), r["dtypes"]
        assert r["output_type"], rank
