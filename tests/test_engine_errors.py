"""Every user-facing error text of the engine, and the replicate fallback's warning."""

import pytest

from tests import checks_engine as C
from tests.compare import assert_every_rank


def _first(pool, kind):
    res = pool.run(C.expect_error, kind)
    assert all(r == res[0] for r in res), "ranks disagree about the error"
    return res[0]


def test_world_size_mismatch(pool4):
    """A grid that does not match the number of processes must not start collectives that hang."""
    kind, msg = _first(pool4, "world")
    assert kind == "UsageError"
    assert "grid=(3, 3) needs 9 processes" in msg and "world size 4" in msg


def test_rectangular_grid_of_the_wrong_size(pool4):
    """A rectangular grid is fine, but its R*C must match the world size: say both numbers."""
    kind, msg = _first(pool4, "rect_wrong_size")
    assert kind == "UsageError"
    assert "grid=(1, 2) needs 2 processes" in msg and "world size 4" in msg


def test_indivisible_weight_is_an_error_when_asked(pool4):
    """A Linear(16, 7) on q=2 cannot be split 2D; the error names the weight, the sizes and the way out."""
    kind, msg = _first(pool4, "indivisible")
    assert kind == "ShardingError"
    assert "weight 0.weight of shape (7, 16)" in msg
    assert "out-features 7 by 2 (columns)" in msg
    assert "indivisible='replicate'" in msg


def test_indivisible_replicate_warns_and_stays_correct(pool4):
    """With indivisible='replicate' the op runs unsplit: one warning naming it, same numbers.
    The warning used to be printed once per rank; rank 0 alone shows it now, and a filter that makes it
    an error still raises on every rank (a rank-dependent raise would leave the others hanging)."""
    res = pool4.run(C.indivisible_replicate)
    _, msgs, _ = res[0]
    assert len(msgs) == 1, msgs
    assert "2 op(s) run unsplit" in msgs[0], msgs
    assert "linear (aten.linear.default) in 0" in msgs[0] and "linear_1 (aten.linear.default) in 2" in msgs[0]
    for rank, (_, msgs, raised) in enumerate(res):
        assert rank == 0 or msgs == [], (rank, msgs)
        assert raised == "FallbackWarning", (rank, raised)
    assert_every_rank([errs for errs, _, _ in res], "unsplit Linear(16, 7)")


def test_capture_failure_points_at_user_line(pool4):
    """torch.export's own error is long and points into torch; ours names the model and its line."""
    kind, msg = _first(pool4, "capture")
    assert kind == "CaptureError"
    assert "could not capture DataDependent" in msg
    assert "checks_engine.py" in msg and "if x.sum() > 0:" in msg
    assert "torch.where" in msg


def test_unknown_lowering(pool4):
    kind, msg = _first(pool4, "lowering")
    assert kind == "UsageError" and "lowering='cannon'" in msg and "'broadcast'" in msg


def test_needs_process_group():
    """Called without init_process_group, parallelize says what to call instead of failing deep inside."""
    import torch

    import autopar

    with pytest.raises(RuntimeError, match="init_process_group"):
        autopar.parallelize(torch.nn.Linear(4, 4), grid=(1, 1), example_inputs=(torch.randn(2, 4),))
