"""Numbers one process would not produce: non-finite values in data that masked-out work reads, and
norms over inputs of extreme magnitude, on real gloo ranks against the unmodified model."""

import pytest

from tests import checks_numerics as N
from tests.compare import assert_every_rank
from tests.conftest import get_pool

FP32 = (1e-4, 1e-5)  # rtol, atol as a fraction of the group's largest reference value
BF16 = (1e-2, 1e-3)  # bf16 keeps 8 bits: one rounding is 4e-3 relative


@pytest.mark.parametrize("name", ["tinygpt", "gpt2", "llama"])
def test_poisoned_unused_embedding_rows(pool4, name):
    """+inf, -inf and NaN in embedding rows that no id reaches (TinyGPT's and GPT-2's positions past
    the sequence, Llama's second vocab block): one process never reads them and stays finite. Catches
    a vocab-split lookup that reads local row 0 for ids outside its block and multiplies it by 0
    (inf * 0 = NaN on every logit and gradient)."""
    per_rank = pool4.run(N.poisoned_embedding, name)
    assert all(r["ref_finite"] for r in per_rank), "premise: the single process must be finite"
    assert_every_rank([r["excess"] for r in per_rank], f"{name} with poisoned unused embedding rows")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_nonfinite_logits_at_ignored_positions(pool4, reduction):
    """NaN and +-inf logits on rows whose target is ignore_index (-100): one process's loss is
    finite. Catches the vocab-parallel cross-entropy zeroing an ignored row's loss by multiplying
    it by 0 (NaN * 0 = NaN) and a backward that differs from torch's on those rows (torch gives
    -softmax * 0 there: NaN on rows holding NaN or +inf, so the gradients must be NaN exactly where
    one process's are; the logits' gradient is compared element-wise)."""
    per_rank = pool4.run(N.faulty_logits, "ignored", reduction)
    assert all(r["ref_loss_finite"] for r in per_rank), "premise: the single process's loss must be finite"
    assert_every_rank([r["excess"] for r in per_rank], f"ignored non-finite logit rows, reduction={reduction}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_masked_vocabulary_column(pool4, reduction):
    """A vocabulary entry masked to -inf in every row (the first of a vocab block, never a target)
    and -inf runs on ignored rows: one process is finite everywhere. Catches the target-logit pick
    reading the block's first column for targets outside the block and multiplying by 0."""
    per_rank = pool4.run(N.faulty_logits, "masked column", reduction)
    assert all(r["ref_loss_finite"] and r["ref_grads_finite"] for r in per_rank), "premise: one process finite"
    assert_every_rank([r["excess"] for r in per_rank], f"-inf vocabulary column, reduction={reduction}")


MAGNITUDES = [(1.0, 0.0), (1e-3, 0.0), (1e15, 0.0), (1.0, 1e4)]  # (scale, mean offset) of the norm's input
FP32_CASES = [(norm, s, o, "float32", *FP32) for norm in ("layer", "rms") for s, o in MAGNITUDES]
BF16_CASES = [(norm, s, o, "bfloat16", *BF16) for norm in ("layer", "rms") for s, o in [(1.0, 0.0), (1e15, 0.0),
                                                                                       (1.0, 1e2)]]


@pytest.mark.parametrize("grid", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
def test_norm_extreme_magnitudes(grid):
    """LayerNorm and RMSNorm over a hidden dim split over the columns, with inputs of magnitude 1,
    1e-3 and 1e15 and with a mean offset of 1e4 over unit noise, fp32 and bf16: the output and
    every gradient equal one process's (up to that process's own distance from float64) and are
    no further from float64 than one process is. Catches a sharded norm whose backward goes through
    rsqrt by autograd (var^-1.5 underflows fp32 at |x| ~ 1e15: input gradients 8% off) and a mean
    subtracted after rounding it to fp32 (an offset of 1e4 then leaves 5e-4 of error on unit noise)."""
    per_rank = get_pool(4).run(N.norm_parity_cases, grid, FP32_CASES + BF16_CASES)
    assert_every_rank(per_rank, f"norms at extreme magnitudes on {grid}")
