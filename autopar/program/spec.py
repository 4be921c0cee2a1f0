"""The shape of a parallel run, parsed once: `parse_spec(grid, strategy, pipeline, data_parallel)` turns the
user's arguments into a `ParallelSpec` that `parallelize`, `plan`, `dry_run`, `choose_plan`'s keywords and
`estimate --dry-run` all read, so that each form is accepted, refused and explained the same way everywhere.

- `grid`: (R, C) one grid of R*C ranks; (dp, R, C) dp replicas of it; with strategy='3d' the cube (q, q, q);
  or a device count p for strategy='auto' to arrange (`ParallelSpec.devices`; `arranged` fills the grid in).
- `strategy`: '2d', '1d', '3d' or 'auto' (validated with the other options by `passes.options.Options`).
- `pipeline`: None, a number of stages S >= 2, or an `autopar.Pipeline`.
- `data_parallel`: what the dp replicas do: 'replicate', 'shard' or 'auto'.

The option values themselves (and their defaults) are `passes.options.Options`'; this module checks how the
four shape arguments combine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autopar.errors import UsageError
from autopar.program.pipe import Pipeline
from passes.options import DEFAULTS

__all__ = ["ParallelSpec", "parse_spec", "check_cube", "check_device_count", "spec_of_dimensions"]


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ParallelSpec:
    """One run's shape (see the module docstring). `grid` is None while `devices` awaits the search."""

    grid: tuple | None
    strategy: str = DEFAULTS.strategy
    pipeline: Pipeline | None = None
    data_parallel: str = DEFAULTS.data_parallel
    devices: int | None = None  # grid=p: a device count for the search to arrange
    cube: bool = False  # the grid is a q x q x q cube (strategy='3d', or the search's 3d arrangement)

    @property
    def dp(self) -> int:
        """Replicas of the tensor-parallel grid (the cube has none)."""
        return self.grid[0] if self.grid is not None and len(self.grid) == 3 and not self.cube else 1

    @property
    def mesh(self) -> tuple:
        """The (R, C) grid each replica runs on; a cube's (q, q*q)."""
        if self.cube:
            return self.grid[0], self.grid[0] ** 2
        return tuple(self.grid[-2:])

    @property
    def stages(self) -> int:
        """Pipeline ranks (1 without stages)."""
        return 1 if self.pipeline is None else self.pipeline.stages

    @property
    def world(self) -> int:
        """The ranks the run needs."""
        return self.devices if self.grid is None else self.stages * math.prod(self.grid)

    @property
    def handshake(self):
        """What ranks compare before they build anything (`autopar.program.guards.agree_on_options`)."""
        if self.grid is None:
            return self.devices
        return self.grid if self.pipeline is None else (self.grid, self.pipeline)

    def arranged(self, grid: tuple, layout: str) -> ParallelSpec:
        """This spec with the search's arrangement of `devices`: `grid`, a cube where `layout` is '3d'."""
        return replace(self, grid=tuple(grid), devices=None, cube=layout == "3d")

    def check_world(self, world: int, who: str) -> None:
        """A device count must equal the ranks that run (`check_device_count`)."""
        if self.devices is not None:
            check_device_count(self.devices, self.strategy, self.pipeline, who, world)

    def kwargs(self) -> dict:
        """`parallelize`'s keywords for this shape (grid, strategy, and where they matter pipeline and
        data_parallel)."""
        out: dict = {"grid": self.devices if self.grid is None else self.grid, "strategy": self.strategy}
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.dp > 1:
            out["data_parallel"] = self.data_parallel
        return out


def parse_spec(grid, strategy: str = DEFAULTS.strategy, pipeline=None, data_parallel: str = DEFAULTS.data_parallel,
               who: str = "autopar.parallelize") -> ParallelSpec:
    """The user's shape arguments as a `ParallelSpec`, or a UsageError naming `who`, what was wrong and what
    would work."""
    if _count(pipeline):
        pipeline = Pipeline(stages=pipeline)
    if pipeline is not None and not isinstance(pipeline, Pipeline):
        raise UsageError(f"{who}: pipeline={pipeline!r}: expected None, a number of stages, or "
                         f"autopar.Pipeline(stages=...)")
    if _count(grid):
        check_device_count(grid, strategy, pipeline, who)
        return ParallelSpec(None, strategy, pipeline, data_parallel, devices=grid)
    if not (isinstance(grid, (tuple, list)) and len(grid) in (2, 3) and all(_count(g) and g >= 1 for g in grid)):
        raise UsageError(f"{who}: grid={grid!r}: expected (R, C) of positive ints, e.g. grid=(2, 2) or (2, 4), "
                         f"(dp, R, C) for dp data-parallel replicas of an R x C grid, (q, q, q) with "
                         f"strategy='3d', or a device count p with strategy='auto' (the search arranges them)")
    check_cube(grid, strategy, pipeline, data_parallel, who)
    return ParallelSpec(tuple(grid), strategy, pipeline, data_parallel, cube=strategy == "3d")


def check_cube(grid, strategy: str, pipeline, data_parallel: str, who: str) -> None:
    """strategy='3d' runs on a cube, grid=(q, q, q), with no pipeline stages and no replicas: anything
    else asked with it is refused rather than dropped."""
    if strategy != "3d":
        return
    extra = " and pipeline stages" if pipeline is not None else \
        " and data_parallel='shard'" if data_parallel == "shard" else ""
    if extra or len(grid) != 3 or len(set(grid)) != 1:
        raise UsageError(f"{who}: strategy='3d' with grid={tuple(grid)}{extra}: 3D tensor parallelism runs on a "
                         f"cube, grid=(q, q, q) on q**3 ranks (e.g. (2, 2, 2) on 8), without pipeline stages or "
                         f"replicas (its third axis takes the place of the replica axis); for (dp, R, C) replicas of "
                         f"a 2D grid use strategy='2d'")


def check_device_count(devices, strategy: str, pipeline, who: str, world: int | None = None) -> None:
    """`grid=p` (a device count) is for the search to arrange: it needs strategy='auto', no pipeline
    stages and, where ranks run, p equal to their number."""
    if not _count(devices) or devices < 1:
        raise UsageError(f"{who}: grid={devices!r}: a device count must be a positive int")
    if strategy != "auto":
        raise UsageError(f"{who}: grid={devices} (a device count) asks the search to arrange the devices, which "
                         f"needs strategy='auto' (got {strategy!r}); for a fixed strategy pass the arrangement, e.g. "
                         f"grid=(R, C) with R * C = {devices}")
    if pipeline is not None:
        raise UsageError(f"{who}: grid={devices} (a device count) with pipeline stages: pass each stage's grid as "
                         f"grid=(R, C), or use autopar.choose_pipeline to arrange stages and grids")
    if world is not None and devices != world:
        raise UsageError(f"{who}: grid={devices} but the process group has {world} ranks: pass grid={world}, or "
                         f"start {devices} processes")


def spec_of_dimensions(par) -> ParallelSpec:
    """The `ParallelSpec` of an estimate's dimensions (`passes.cost.step.Parallel`: tp as (t,) 1D, (R, C) 2D or
    (q, q, q) the cube; dp_shard, dp_replicate; pp, schedule, microbatches, interleave): what `parallelize`
    builds for the configuration `autopar.estimate` prices. Sharded replicas inside replicated ones (HSDP)
    are not a mode of parallelize, nor are replicas of a cube: refused."""
    dp = par.dp_shard * par.dp_replicate
    if getattr(par, "cp", 1) > 1 and (par.dp_replicate > 1 or par.pp > 1 or len(par.tp) == 3):
        raise UsageError(f"cp={par.cp} with {par.dp_replicate} replicated replicas, {par.pp} stages, "
                         f"tp={tuple(par.tp)}: autopar.parallelize runs context parallelism beside an (R, C) grid and "
                         f"sharded replicas (context_parallel=cp, grid=(dp_shard, R, C), data_parallel='shard': the "
                         f"blocks sharded over dp_shard x cp ranks)")
    if par.shard_optimizer:
        raise UsageError("shard_optimizer (the replicas splitting the optimizer states, ZeRO-1) is priced by "
                         "autopar.estimate but not built by autopar.parallelize: dry-run the configuration without "
                         "it (the program is the same but for the replicas' gradient exchange)")
    if par.dp_shard > 1 and par.dp_replicate > 1:
        raise UsageError(f"dp_shard={par.dp_shard} inside dp_replicate={par.dp_replicate} (HSDP) is not a mode of "
                         f"autopar.parallelize: give the replicas one mode, dp_shard or dp_replicate alone")
    tp = tuple(par.tp)
    if len(tp) == 3:
        if dp > 1:
            raise UsageError(f"tp={tp} (the cube) with {dp} replicas: 3D tensor parallelism runs without replicas in "
                             f"autopar.parallelize; use a 2D grid (R, C) for replicas")
        grid, strategy = tp, "3d"
    else:
        grid, strategy = (tp if len(tp) == 2 else (1, tp[0])), "2d" if len(tp) == 2 else "1d"
        grid = (dp, *grid) if dp > 1 else grid
    pipeline = Pipeline(stages=par.pp, schedule=par.schedule, microbatches=par.microbatches,
                        stages_per_rank=par.interleave) if par.pp > 1 else None
    return parse_spec(grid, strategy, pipeline, "shard" if par.dp_shard > 1 else "replicate",
                      who="autopar.estimate's configuration")
