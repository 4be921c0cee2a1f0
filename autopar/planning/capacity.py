"""`max_batch`: the largest batch whose estimated memory per rank fits a limit, for 2D, 1D and auto,
with and without recomputation, on one process without the hardware.

Memory per rank is the strategy search's estimate (`passes.search.strategy`): parameter blocks times
(2 + optimizer states) (the parameter, its gradient, AdamW's two states) plus every intermediate that
needs a gradient (an upper bound on what autograd saves), and with recompute='blocks' only each
block's inputs plus one block rebuilt in backward (`passes.search.recompute_cost`). For a fixed strategy
that memory is P + A·b in the batch b (parameters do not grow with it, activations grow linearly), so
two captures (b = L and 2L) give P and A and the answer is floor((limit - P) / A) rounded down to a
multiple of L, the rows of the grid that split the batch. strategy='auto' chooses per batch, so its
largest batch is found by bisection from the larger of fixed 2D's and fixed 1D's (both in its search
space), one capture and one search per probe.

Schemes, for p = R·C devices:

    2d       SUMMA on the R x C grid
    1d       Megatron 1D over all p devices (a 1 x p grid)
    1d x dp  1D over the C columns, the batch split over the R rows: C-way 1D times R-way data
             parallelism (weights replicated over the rows)
    auto     strategy='auto' on the R x C grid: per matmul group, the fastest option that fits
"""

from __future__ import annotations

from dataclasses import dataclass

from passes.search import strategy as strategies
from autopar.planning.progress import steps
from passes.options import DEFAULTS, Options
from autopar.errors import UsageError

__all__ = ["Capacity", "max_batch", "SCHEMES"]

SCHEMES = ("2d", "1d", "1d x dp", "auto")
PROBES = 5  # bisection steps of strategy='auto'


@dataclass(frozen=True)
class Capacity:
    scheme: str
    grid: tuple  # (R, C) the scheme runs on
    recompute: bool  # every repeated block recomputed in backward
    batch: int  # the largest batch that fits (sequences per step over all p devices); 0: none
    memory_bytes: float  # the estimate per rank at that batch (at the smallest batch when none fits)
    param_bytes: float  # parameter blocks per rank (without gradients and optimizer states)


def _scheme_grid(scheme: str, grid: tuple) -> tuple:
    R, C = grid
    return (1, R * C) if scheme == "1d" else (R, C)


def _estimate(cap, grid: tuple, strategy: str, options: Options, cm):
    if strategy == "auto":
        return strategies.choose(cap.gm, grid, cm, options).estimate
    return strategies.estimate_fixed(cap.gm, grid, cm, strategy, options)


def max_batch(make, grid, memory_limit: float, *, schemes=SCHEMES, recompute=(False, True),
              cost_model: object = DEFAULTS.cost_model, optimizer_states: int = DEFAULTS.optimizer_states,
              search_budget: float | None = 10.0, progress: bool = True) -> list:
    """[Capacity] per scheme (see the module docstring) and recomputation setting, on an R x C `grid`,
    for `memory_limit` bytes per rank. `make(batch)` returns (model, args, kwargs) for one step of
    `batch` sequences (a model on the meta device is enough: nothing is allocated). `progress`: a bar
    on rank 0's stderr when it runs for more than a few seconds (`autopar.planning.progress`)."""
    from autopar.program.build import capture, resolve_cost_model

    memory_limit = Options(memory_limit=memory_limit).memory_limit  # '80GiB' or bytes, checked as parallelize does
    if memory_limit is None:
        raise UsageError("max_batch needs a memory_limit: bytes per rank (e.g. 40 * 2**30) or a string with a "
                         "unit ('40GiB')")
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise UsageError(f"schemes={bad!r}: expected some of {SCHEMES}")
    cm = resolve_cost_model(cost_model)
    captured: dict = {}

    def cap(batch):
        if batch not in captured:
            model, args, kwargs = make(batch)
            captured[batch] = (capture(model, args, kwargs or {}))
        return captured[batch]

    out = []
    with steps("autopar max_batch", len(schemes) * len(recompute), progress) as bar:
        for scheme in schemes:
            g = _scheme_grid(scheme, tuple(grid))
            strategy = {"2d": "2d", "1d": "1d", "1d x dp": "1d", "auto": "auto"}[scheme]
            for rc in recompute:
                bar.set_postfix_str(f"{scheme}{' + recompute' if rc else ''}")
                options = Options(strategy=strategy, recompute="blocks" if rc else False,
                                  optimizer_states=optimizer_states, search_budget=search_budget)
                if strategy == "auto":
                    out.append(_auto(cap, g, memory_limit, options, cm, out, rc))
                else:
                    out.append(_linear(cap, scheme, g, memory_limit, options, cm, rc))
                bar.update()
    return out


def _linear(cap, scheme, grid, limit, options, cm, rc) -> Capacity:
    step = grid[0]
    one, two = (_estimate(cap(b), grid, options.strategy, options, cm) for b in (step, 2 * step))
    per = (two.memory_bytes - one.memory_bytes) / step  # bytes per sequence
    fixed = one.memory_bytes - per * step
    batch = int((limit - fixed) // per) // step * step if per > 0 and limit > fixed else 0
    batch = max(batch, 0)
    memory = fixed + per * batch if batch else one.memory_bytes
    return Capacity(scheme, grid, rc, batch, memory, one.param_bytes)


def _auto(cap, grid, limit, options, cm, done, rc) -> Capacity:
    """Bisection over multiples of the grid's rows between the best fixed scheme's batch (which auto's
    search space holds) and twice it."""
    step = grid[0]
    lo = max((c.batch for c in done if c.recompute == rc and c.scheme in ("2d", "1d x dp")), default=0)
    hi = 2 * lo + 2 * step
    limited = Options(**{**dict(options.items()), "memory_limit": limit})
    found = None
    for _ in range(PROBES):
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        try:
            found = _estimate(cap(mid), grid, "auto", limited, cm)
            lo = mid
        except MemoryError:
            hi = mid
    if lo == 0:  # nothing fits: the unconstrained estimate at the smallest batch says by how much
        est = _estimate(cap(step), grid, "auto", options, cm)
    else:
        est = found if found is not None else _estimate(cap(lo), grid, "auto", limited, cm)
    return Capacity("auto", grid, rc, lo, est.memory_bytes, est.param_bytes)


def table(rows: list, limit: float) -> str:
    """The capacities as Markdown: one row per scheme, the largest batch without and with recomputation."""
    by = {(c.scheme, c.recompute): c for c in rows}
    lines = [f"| scheme | grid | params/rank | largest batch ({limit / 2**30:g} GiB) | with recompute='blocks' |",
             "|---|---|---|---|---|"]
    for scheme in dict.fromkeys(c.scheme for c in rows):
        plain, again = by.get((scheme, False)), by.get((scheme, True))
        first = plain or again
        assert first is not None, f"no capacity computed for {scheme}"
        lines.append(f"| {scheme} | {first.grid[0]}x{first.grid[1]} | {first.param_bytes / 2**30:.2f} GiB | "
                     f"{plain.batch if plain else '-'} | {again.batch if again else '-'} |")
    return "\n".join(lines)


def ratio(rows: list, scheme: str, against: str, rc: bool) -> float | None:
    """batch(scheme) / batch(against) at the same recomputation setting (None when against fits none)."""
    by = {(c.scheme, c.recompute): c.batch for c in rows}
    b = by.get((against, rc))
    return by[(scheme, rc)] / b if b else None

