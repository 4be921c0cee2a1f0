"""Ragged batches: a model parallelized at one (batch, sequence) shape, then called with shapes the
grid does not divide (3x7, 1x5), with the captured one again and with a larger ragged one (5x9), in
train and eval mode. Every call must match one process (logits, loss and every gradient on every
rank, tests/compare.py tolerances), keep every parameter's stored blocks as they are, and run without
gathering ops whole (no FallbackWarning)."""

import pytest

from tests import checks_ragged as C
from tests.compare import assert_every_rank


def _check(res, what):
    assert_every_rank([r["excess"] for r in res], what)
    for rank, r in enumerate(res):
        assert not r["warned"], f"{what}: rank {rank} warned: {r['warned']}"
        assert not r["moved"], f"{what}: rank {rank}: parameters whose stored blocks changed: {r['moved']}"
        assert r["compiles"] == 8, f"{what}: rank {rank}: {r['compiles']} programs (train: 1 + 3 shapes, eval: 4)"


@pytest.mark.parametrize("grid", [(2, 2), (1, 4), (2, 2, 1)], ids=["2x2", "1x4", "2x1-dp2"])
def test_repo_model_ragged_batches(pool4, grid):
    """Catches parameter layouts that depend on the input shape (the recompile for a batch of 3 on 2
    mesh rows used to replicate every weight and raise), a weight gradient summed over mesh rows that
    all hold the whole batch (R times too large), and a loss mean divided over rows it was not split
    over."""
    _check(pool4.run(C.ragged_parity, "tiny", grid), f"TinyGPT {grid}")


@pytest.mark.parametrize("family,grid", [("llama", (2, 2)), ("gpt2", (2, 2)), ("llama", (1, 4))])
def test_hf_ragged_batches(pool4, family, grid):
    """The same for transformers models: Llama (rotary positions, grouped-query attention, untied head)
    and GPT-2 (Conv1D addmm weights, fused c_attn, tied head), whose loss flattens batch and sequence."""
    _check(pool4.run(C.ragged_parity, family, grid), f"{family} {grid}")


@pytest.mark.parametrize("options", [dict(strategy="1d"), dict(lowering="allgather")], ids=["1d", "allgather"])
def test_repo_model_ragged_batches_options(pool4, options):
    """strategy='1d' recompiles keep its column/row splits (pinned layouts are read as their 1D form,
    not redone as SUMMA); the all-gather lowering's weight gradient for a batch whole over the rows
    is this row's slice, not a reduce-scatter of R equal copies."""
    _check(pool4.run(C.ragged_parity, "tiny", (2, 2), **options), f"TinyGPT {options}")


def test_new_parameter_is_named(pool4):
    """The one thing a recompile cannot keep, a parameter the parallelized model did not have, is
    refused naming it and saying what to do."""
    msg = pool4.run(C.new_parameter_refused)[0]
    assert "parameter 'blocks.0.mlp.up.bias'" in msg and "did not exist when the model was parallelized" in msg, msg
    assert "Give it its final shape before parallelize" in msg, msg
