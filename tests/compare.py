"""Element-wise comparison of a parallel result with the single-process reference.

`excess(got, want, rtol, atol)` is max over elements of |got - want| / (atol + rtol * |want|): at most
1 means every element is within torch.isclose's tolerance. Neither a pure relative error nor a switch
to absolute error below a threshold fits gradients: a key-projection bias has a gradient that is zero
in exact arithmetic, so both runs hold rounding noise (~1e-9) that a relative error reads as ~100%,
while an absolute 1e-4 would pass a 10x error on a genuinely small gradient. So tests state an `rtol`
and an `atol` scaled to the magnitude of the tensors being compared (`scaled_atol`: a fraction of the
largest value among a model's gradients, or among its outputs).

Non-finite values must match exactly: the same inf in both passes; a NaN or inf on one side only fails
(returns inf), so a NaN where one process is finite can never pass.

    >>> import torch
    >>> excess(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0001]), rtol=1e-4, atol=0.0) <= 1
    True
    >>> excess(torch.tensor([float("nan")]), torch.tensor([1.0]), rtol=1e-4, atol=1e-6)
    inf

A rank-side check compares a group of tensors with one atol (`group_excess`) and returns
{name: excess}; the test collects that from every rank and asserts `failures(per_rank) == {}`:

    >>> big, small = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 2e-6])
    >>> errs = group_excess({"w": (big, big), "b": (small + 5e-9, small)})  # atol = 1e-5 * 1.0
    >>> failures([errs, errs])
    {}
    >>> failures([errs, {"w": 0.0, "b": 3.0}])  # rank 1 drifted on "b"
    {(1, 'b'): 3.0}
"""

from __future__ import annotations

import math

import torch

RTOL = 1e-4  # fp32 parity: relative part of the tolerance
ATOL_FRAC = 1e-5  # absolute part: this fraction of the largest magnitude among the compared group


def excess(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = 0.0) -> float:
    """max |got - want| / (atol + rtol |want|) over the elements (0 for two empty tensors)."""
    got = torch.as_tensor(got).detach().double().cpu()
    want = torch.as_tensor(want).detach().double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: got {tuple(got.shape)}, want {tuple(want.shape)}")
    if got.numel() == 0:
        return 0.0
    finite = torch.isfinite(want) & torch.isfinite(got)
    same_nonfinite = (~torch.isfinite(want)) & ((got == want) | (got.isnan() & want.isnan()))
    if not bool((finite | same_nonfinite).all()):
        return math.inf
    if not bool(finite.any()):
        return 0.0
    g, w = got[finite], want[finite]
    tol = atol + rtol * w.abs()
    diff = (g - w).abs()
    if bool((tol == 0).any()):  # atol=0 and want exactly 0: only an exact match passes
        if bool((diff[tol == 0] > 0).any()):
            return math.inf
        keep = tol > 0
        g, w, tol, diff = g[keep], w[keep], tol[keep], diff[keep]
        if diff.numel() == 0:
            return 0.0
    return float((diff / tol).max())


def scaled_atol(tensors, frac: float = ATOL_FRAC) -> float:
    """`frac` times the largest finite magnitude among `tensors` (e.g. all reference gradients of a
    model): the rounding noise of fp32 arithmetic scales with the values that flow, not with each
    tensor's own maximum."""
    top = 0.0
    for t in tensors:
        t = torch.as_tensor(t).detach()
        t = t[torch.isfinite(t)] if t.is_floating_point() else t
        if t.numel():
            top = max(top, float(t.abs().max()))
    return frac * top


def failures(per_rank: list, limit: float = 1.0) -> dict:
    """From per-rank dicts {name: excess}, the entries above `limit` as {(rank, name): excess}; also
    flags a rank that reports other names than rank 0 (a value missing on one rank goes unseen)."""
    if not per_rank or not per_rank[0]:
        raise AssertionError(f"nothing was compared: per-rank results {per_rank!r}")
    bad = {}
    names = set(per_rank[0])
    for rank, errs in enumerate(per_rank):
        if set(errs) != names:
            bad[(rank, "<names differ from rank 0>")] = sorted(set(errs) ^ names)
        for name, v in errs.items():
            if not v <= limit:
                bad[(rank, name)] = v
    return bad


def group_excess(pairs: dict, rtol: float = RTOL, frac: float = ATOL_FRAC, prefix: str = "") -> dict:
    """{prefix + name: excess(got, want, rtol, atol)} for pairs {name: (got, want)} that share one
    atol: `frac` times the largest reference value in the group (e.g. all gradients of one model)."""
    atol = scaled_atol((want for _, want in pairs.values()), frac)
    return {prefix + name: excess(got, want, rtol, atol) for name, (got, want) in pairs.items()}


def assert_every_rank(per_rank: list, what: str = "") -> float:
    """Fails naming every (rank, tensor) above tolerance; returns (and prints) the largest excess."""
    bad = failures(per_rank)
    assert bad == {}, f"{what}: above tolerance as {{(rank, tensor): excess}}: {bad}"
    top = max(v for errs in per_rank for v in errs.values())
    print(f"{what}: max excess {top:.3g} over {len(per_rank)} rank(s)")
    return top
