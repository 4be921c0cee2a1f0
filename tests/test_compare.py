"""The comparison every parity test relies on (tests/compare.py), tested on the cases that broke the
earlier per-tensor relative error: a gradient that is zero in exact arithmetic, a genuinely small
gradient that is 10x off, non-finite values, and one rank that drifts."""

import doctest
import math

import pytest
import torch

from tests import compare
from tests.compare import ATOL_FRAC, RTOL, excess, failures, group_excess, scaled_atol


def _grads(seed=0):
    """A model's gradients: a large weight gradient, a genuinely small bias gradient, and a key bias
    gradient that is zero in exact arithmetic (softmax is shift-invariant)."""
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(16, 16, generator=g) * 1e-2,
            "small bias": torch.full((16,), 3e-6) + torch.rand(16, generator=g) * 1e-6,
            "key bias": torch.zeros(16)}


def test_zero_gradient_with_rounding_noise_passes():
    """Catches a comparison that reads fp32 rounding noise on an exactly-zero gradient as a 100%
    relative error (both runs hold ~1e-9 of noise, with different signs)."""
    want = _grads()
    want["key bias"] = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 1e-9
    got = {n: w.clone() for n, w in want.items()}
    got["key bias"] = -want["key bias"]  # the other run's noise: 100% relative error
    errs = group_excess({n: (got[n], want[n]) for n in want})
    assert failures([errs]) == {}, errs
    rel = float(((got["key bias"] - want["key bias"]).abs() / want["key bias"].abs()).max())
    assert rel >= 1.0  # what a pure relative error would have reported


def test_tenfold_error_on_a_small_gradient_fails():
    """Catches a fixed absolute tolerance (1e-4) that passes a 10x error on a gradient of ~3e-6: the
    atol must follow the model's gradient magnitudes (here 1e-5 x ~3e-2)."""
    want = _grads()
    got = {n: w.clone() for n, w in want.items()}
    got["small bias"] = 10 * want["small bias"]
    atol = scaled_atol(want.values())
    assert atol < 1e-6, atol
    assert float((got["small bias"] - want["small bias"]).abs().max()) < 1e-4  # an atol of 1e-4 would pass
    errs = group_excess({n: (got[n], want[n]) for n in want})
    assert set(failures([errs])) == {(0, "small bias")}, errs


def test_nan_where_reference_is_finite_fails():
    """Catches a NaN slipping through (NaN compares False with everything, so `diff < tol` style
    checks written as `not diff > tol` would pass it)."""
    want = torch.tensor([1.0, 2.0, 3.0])
    got = want.clone()
    got[1] = float("nan")
    assert excess(got, want, RTOL, 1e-3) == math.inf
    assert failures([{"out": excess(got, want, RTOL, 1e-3)}]) == {(0, "out"): math.inf}
    assert excess(want, got, RTOL, 1e-3) == math.inf  # NaN in the reference only: also a mismatch


def test_same_inf_passes_and_other_inf_fails():
    """A masked score of -inf on both sides is agreement, not an error; -inf against +inf, or inf
    against a finite value, is not."""
    want = torch.tensor([float("-inf"), 1.0, float("inf")])
    assert excess(want.clone(), want, RTOL, 0.0) == 0.0
    flipped = want.clone()
    flipped[0] = float("inf")
    assert excess(flipped, want, RTOL, 0.0) == math.inf
    finite = want.clone()
    finite[2] = 3e38
    assert excess(finite, want, RTOL, 0.0) == math.inf


def test_boundary_is_isclose():
    """excess <= 1 exactly when torch.isclose(got, want, rtol, atol) holds for every element."""
    want = torch.tensor([0.0, 1e-3, 1.0, -50.0])
    atol, rtol = 1e-6, 1e-4
    for scale in (0.5, 0.99, 1.01, 2.0):
        got = want + scale * (atol + rtol * want.abs())
        assert (excess(got, want, rtol, atol) <= 1) == bool(torch.isclose(got, want, rtol, atol).all()), scale


def test_exact_comparison_with_zero_tolerance():
    """rtol = atol = 0 asks for bit equality (a checkpoint load): any difference, even on a zero, fails."""
    want = torch.tensor([0.0, 1.0])
    assert excess(want.clone(), want, 0.0, 0.0) == 0.0
    assert excess(torch.tensor([1e-30, 1.0]), want, 0.0, 0.0) == math.inf
    assert excess(torch.tensor([0.0, 1.0 + 1e-7]), want, 0.0, 0.0) == math.inf


def test_one_drifting_rank_is_reported():
    """Catches a check that reads only rank 0: a replicated value that drifts on rank 2 is named."""
    want = _grads()
    per_rank = []
    for rank in range(4):
        got = {n: w.clone() for n, w in want.items()}
        if rank == 2:
            got["weight"][3, 5] += 1e-3  # one element of a replicated copy
        per_rank.append(group_excess({n: (got[n], want[n]) for n in want}))
    bad = failures(per_rank)
    assert list(bad) == [(2, "weight")], bad
    with pytest.raises(AssertionError, match=r"\(2, 'weight'\)"):
        compare.assert_every_rank(per_rank, "drift")


def test_missing_name_on_one_rank_and_empty_results_fail():
    """A tensor compared on rank 0 but not on rank 1 is flagged; a check that compared nothing fails."""
    bad = failures([{"a": 0.1, "b": 0.2}, {"a": 0.1}])
    assert bad == {(1, "<names differ from rank 0>"): ["b"]}
    with pytest.raises(AssertionError, match="nothing was compared"):
        failures([{}, {}])


def test_scaled_atol_ignores_non_finite():
    """The atol follows the largest finite magnitude, so one masked -inf does not blow it up."""
    assert scaled_atol([torch.tensor([float("-inf"), -2.0, 1.0])], 0.5) == 1.0
    assert scaled_atol([torch.zeros(3), torch.tensor([4.0])]) == ATOL_FRAC * 4.0


def test_doctests():
    """The examples in tests/compare.py's docstrings run and hold."""
    result = doctest.testmod(compare)
    assert result.attempted > 0 and result.failed == 0, result
