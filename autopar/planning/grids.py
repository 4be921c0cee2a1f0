"""`search_grids`: how to arrange p devices, and how to split each matmul on them, from one estimate.

The candidates for p devices:

    R x C      every R * C = p (1 x p: 1D tensor parallelism over all of them); each matmul unit
               among 2d / 1d / rep (`passes.search.strategy`)
    q x q x q  where p = q^3: the cube of 3D tensor parallelism, on its (q, q*q) grid; each unit among
               3d / 2d / 1d / rep (a unit under 2d runs SUMMA on the (q, q*q) grid)
    d x R x C  with `replicas`, every d > 1 dividing p and the example batch: d data-parallel
               replicas of an R x C grid, each computing 1/d of the batch (2.5D's layout where R = C);
               units as on R x C, the replicas' gradient all-reduce priced (`replica_cost`)

Every candidate is first priced under its fixed schemes (all 2d, all 1d, and all 3d on the cube); the
`SEARCHED` candidates whose best fixed scheme is fastest then get the per-unit search, which never
returns an assignment slower than its own fixed schemes. The best fixed scheme over all candidates is
among those searched, so the pick is never estimated slower than any fixed scheme on any arrangement.
Each unit's lowering is chosen inside the same estimate (broadcast or all-gather; the ring only when
asked for by name). Time and memory are the same estimate `strategy='auto'` uses, for the same global
batch: a candidate with replicas is captured again on its 1/d slice of the example inputs.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import NamedTuple

from passes.compat import pytree
from passes.cost.model import CostModel
from passes.errors import MemoryLimitError
from passes.options import Options, format_bytes
from passes.search import strategy as strategies
from autopar.errors import UsageError
from autopar.program.build import cache_off_kwargs, capture, check_example_inputs

__all__ = ["GridChoice", "candidates", "describe", "replica_inputs", "cube_side",
           "search_grids", "SEARCHED"]

SEARCHED = 8  # candidates that get the per-unit search, the fastest by their fixed schemes


def cube_side(p: int) -> int | None:
    """q where p = q^3 with q >= 2, else None."""
    q = round(p ** (1 / 3))
    return next((s for s in (q - 1, q, q + 1) if s >= 2 and s ** 3 == p), None)


def candidates(p: int, batch: int | None = None, *, cube: bool = True, replicas: bool = True) -> list:
    """(layout, grid) of every arrangement of p devices: ("2d", (R, C)) for each R * C = p, ("3d",
    (q, q, q)) where p = q^3 and `cube`, ("replicas", (d, R, C)) for each d > 1 dividing p and
    `batch` when `replicas` (without a batch size, none)."""
    out = [("2d", (r, p // r)) for r in range(1, p + 1) if p % r == 0]
    q = cube_side(p)
    if cube and q is not None:
        out.append(("3d", (q, q, q)))
    if replicas and batch:
        for d in range(2, p + 1):
            if p % d == 0 and batch % d == 0:
                out += [("replicas", (d, r, p // d // r)) for r in range(1, p // d + 1) if (p // d) % r == 0]
    return out


class GridChoice(NamedTuple):
    """The arrangement picked and the table of every candidate; unpacks as (grid, table)."""

    grid: tuple  # (R, C), (q, q, q) for the cube, or (d, R, C) for replicas
    table: list  # a row (dict) per candidate, in `candidates` order

    @property
    def best(self) -> dict:
        return next(row for row in self.table if row.get("picked"))

    @property
    def layout(self) -> str:
        """'2d' (one R x C grid), '3d' (the cube) or 'replicas'."""
        return self.best["layout"]

    @property
    def choice(self):
        """The per-unit search's Choice on the arrangement picked (`passes.search.strategy.Choice`)."""
        return self.best["choice"]

    def to_json(self) -> list:
        """The table without the searches' Choice objects (their assignments stay), grids as lists."""
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in row.items() if k != "choice"}
                for row in self.table]

    @property
    def kwargs(self) -> dict:
        """What to pass `autopar.parallelize` (or `plan`) for this arrangement: the cube's per-unit mix
        of 3d and 2d is reached by the device count (`grid=p`, which searches the same candidates
        without replicas), a grid or replicas by their tuple, each with strategy='auto'."""
        grid = math.prod(self.grid) if self.layout == "3d" else self.grid
        return {"grid": grid, "strategy": "auto"}


def describe(layout: str, grid: tuple) -> str:
    """'the 2x4 grid', 'the 2x2x2 cube' or '2 replicas of the 1x4 grid'."""
    if layout == "3d":
        return f"the {grid[0]}x{grid[0]}x{grid[0]} cube"
    where = f"the {grid[-2]}x{grid[-1]} grid"
    return f"{grid[0]} replicas of {where}" if layout == "replicas" else where


def _batch_of(args, kwargs) -> int | None:
    """The leading size of the example's first tensor with at least one dim."""
    return next((t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if getattr(t, "ndim", 0) >= 1), None)


def replica_inputs(args, kwargs, d: int) -> tuple:
    """(args, kwargs) one of d replicas computes on: each tensor whose leading size is the batch (the
    first tensor's), its first batch/d rows; other values as they are. What `search_grids` prices a
    d x R x C candidate with."""
    batch = _batch_of(args, kwargs)

    def cut(t):
        return t[: batch // d] if getattr(t, "ndim", 0) >= 1 and t.shape[0] == batch else t
    return pytree.tree_map(cut, (args, kwargs))


def search_grids(model, devices: int, example_inputs=(), example_kwargs=None, options: Options | None = None, *,
                 replicas: bool = True, who: str = "autopar.choose_grid") -> GridChoice:
    """The arrangement of `devices` (see the module's text) whose per-unit assignment has the smallest
    estimated step time within `options.memory_limit`, and a row per candidate: its fixed schemes'
    estimates, and for the searched ones the search's. Raises a MemoryLimitError naming the smallest
    footprint when nothing fits."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise UsageError(f"{who}: devices={devices!r}: expected the number of ranks to arrange, a positive int")
    options = options or Options(strategy="auto")
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    check_example_inputs(model, example_inputs, example_kwargs, who)
    kwargs = {**cache_off_kwargs(model), **(example_kwargs or {})}
    cm = CostModel.resolve(options.cost_model)
    batch = _batch_of(example_inputs, kwargs)
    cands = candidates(devices, batch, replicas=replicas)
    limit = options.memory_limit_bytes
    graphs = {1: capture(model, example_inputs, kwargs).gm}
    rows = []
    for layout, grid in cands:
        d = grid[0] if layout == "replicas" else 1
        if d not in graphs:
            graphs[d] = capture(model, *replica_inputs(example_inputs, kwargs, d)).gm
        mesh = (grid[0], grid[0] ** 2) if layout == "3d" else grid[-2:]
        opts = replace(options, replicas=d)
        schemes = ("2d", "1d", "3d") if layout == "3d" else ("2d", "1d")
        fixed = {s: strategies.estimate_fixed(graphs[d], mesh, cm, s, opts) for s in schemes}
        fits = {s: e for s, e in fixed.items() if limit is None or e.memory_bytes <= limit}
        rows.append({"grid": grid, "layout": layout, "mesh": mesh, "fixed_s": {s: e.time_s for s, e in fixed.items()},
                     "2d_s": fixed["2d"].time_s, "1d_s": fixed["1d"].time_s,
                     "fixed_memory_bytes": min(e.memory_bytes for e in fixed.values()),
                     "screen_s": min((e.time_s for e in fits.values()), default=math.inf),
                     "fits": None, "searched": False, "auto_s": None, "picked": False, "_d": d})
    ranked = sorted(rows, key=lambda r: (r["screen_s"], r["fixed_memory_bytes"]))
    for row in ranked[:SEARCHED]:
        opts = replace(options, replicas=row["_d"])
        extra = ("3d",) if row["layout"] == "3d" else ()
        t0 = time.perf_counter()
        try:
            c = strategies.choose(graphs[row["_d"]], row["mesh"], cm, opts, extra)
        except MemoryError as e:
            row.update(fits=False, searched=True, why=str(e), solve_s=time.perf_counter() - t0)
            continue
        row.update(fits=True, searched=True, auto_s=c.estimate.time_s, memory_bytes=c.estimate.memory_bytes,
                   assignment=c.assignment, choice=c, solve_s=c.solve_s)
    for row in rows:
        del row["_d"]
        if not row["searched"]:
            row["fits"] = row["screen_s"] < math.inf
            row["why"] = (f"not searched: its best fixed scheme ({row['screen_s'] * 1e3:.3f} ms) is slower than "
                          f"those of the {SEARCHED} searched" if row["fits"] else
                          f"no fixed scheme fits memory_limit (smallest {format_bytes(row['fixed_memory_bytes'])})")
    ok = [row for row in rows if row["searched"] and row["fits"]]
    if not ok:
        least = min(rows, key=lambda r: r["fixed_memory_bytes"])
        raise MemoryLimitError(
            f"{who}: no arrangement of {devices} devices fits memory_limit={format_bytes(limit)} per rank: the "
            f"smallest fixed-scheme estimate is {format_bytes(least['fixed_memory_bytes'])}, on "
            f"{describe(least['layout'], least['grid'])}. Use more devices, a smaller batch, recompute='blocks', or a "
            f"larger limit.")
    best = min(ok, key=lambda row: row["auto_s"])
    best["picked"] = True
    return GridChoice(best["grid"], rows)
