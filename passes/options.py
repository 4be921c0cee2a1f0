"""The options of a compile, validated once.

`parallelize` and `plan` build one `Options` from their keyword arguments and pass it down to the
passes (`strategy.choose`, `propagate`), so every stage reads the same values with the same defaults
and no stage re-checks them. A bad value raises a `UsageError` (a ValueError) naming the option, the value given,
the values expected and what to pass instead, before anything is captured.

>>> Options().indivisible
'uneven'
>>> Options(lowering="ring")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
passes.errors.UsageError: lowering='ring': expected one of ('broadcast', 'allgather'); pass one of these, ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from passes.cost.model import CostModel
from passes.errors import UsageError

__all__ = ["Options", "DEFAULTS", "BUDGET_S", "STRATEGIES", "RECOMPUTE_MODES", "INDIVISIBLE"]

LOWERINGS = ("broadcast", "allgather")  # how a SUMMA product moves its panels (passes.ops.summa)
BUCKET_MB = 25.0  # default cap per replica gradient bucket, MiB (what DistributedDataParallel uses)
BUDGET_S = 30.0  # default search_budget: seconds before the search stops with the best found so far
STRATEGIES = ("2d", "1d", "auto")
RECOMPUTE_MODES = ("blocks", "selective")  # passes.transforms.recompute.MODES
# a dim the grid does not divide: split in torch.chunk blocks where a rule can, else run unsplit (the
# only choice for "replicate"), or raise
INDIVISIBLE = ("uneven", "replicate", "error")


@dataclass(frozen=True)
class Options:
    """How a model is compiled and run; the defaults are `parallelize`'s. See `parallelize` for what
    each option means. `optimizer_states` (per-parameter tensors of the optimizer; AdamW: 2) only
    enters strategy='auto''s memory estimate; `check_inputs`, `timeout` and `compile` only the run time.
    `forward_only` (set by `pmodel.generate` for a phase's own plan, not a `parallelize` keyword): the
    search prices a forward with no backward, no gradient reductions, nothing saved for backward and no
    gradient or optimizer state, which is what inference runs."""

    lowering: str = "broadcast"
    indivisible: str = "uneven"  # split in torch.chunk blocks; "replicate", "error": see `parallelize`
    fused: str = "regroup"
    on_unsupported: str = "replicate"
    strategy: str = "2d"
    cost_model: object = None  # None, a CostModel, a dict or a path of `autopar calibrate` JSON
    memory_limit: float | None = None  # bytes per rank, for strategy='auto'
    search_budget: float | None = BUDGET_S  # seconds, for strategy='auto'
    check_inputs: bool = False
    timeout: float | None = None  # seconds
    optimizer_states: int = 2
    compile: bool = False  # run each rank's program under torch.compile
    recompute: str | bool | None = None  # None, False, "blocks" or "selective": see passes.transforms.recompute
    forward_only: bool = False  # strategy='auto' prices a forward alone (a generation phase): see below
    grad_bucket_mb: float = BUCKET_MB  # grid=(d, R, C): MiB of gradients per replica all-reduce
    moe_dispatch: str = "auto"  # how routed tokens reach their experts: see passes.transforms.route_experts

    def __post_init__(self) -> None:
        _one_of("lowering", self.lowering, LOWERINGS)
        _one_of("indivisible", self.indivisible, INDIVISIBLE)
        _one_of("fused", self.fused, ("regroup", "interleave"))
        _one_of("on_unsupported", self.on_unsupported, ("replicate", "error"))
        _one_of("moe_dispatch", self.moe_dispatch, ("auto", "all_to_all", "gather"))
        if self.strategy not in STRATEGIES:
            raise UsageError(f"strategy={self.strategy!r}: expected '2d' (SUMMA), '1d' (Megatron column/row splits "
                             f"over the grid's columns) or 'auto' (chosen per matmul from estimated step time)")
        if self.cost_model is not None and not isinstance(self.cost_model, (CostModel, dict, str,
                                                                              os.PathLike)):
            raise UsageError(f"cost_model={self.cost_model!r}: expected None (published GPU-cluster figures), the "
                             f"path or dict of JSON that `autopar calibrate` wrote, or a passes.cost.model.CostModel")
        if self.memory_limit is not None and not (_number(self.memory_limit) and self.memory_limit > 0):
            raise UsageError(f"memory_limit={self.memory_limit!r}: expected a positive number of bytes per rank "
                             f"(e.g. 40 * 2**30), or None for no limit")
        if self.search_budget is not None and not (_number(self.search_budget) and self.search_budget >= 0):
            raise UsageError(f"search_budget={self.search_budget!r}: expected seconds >= 0 (e.g. {BUDGET_S:g}) or "
                             f"None for no time limit")
        if not isinstance(self.check_inputs, bool):
            raise UsageError(f"check_inputs={self.check_inputs!r}: expected True (compare every call's inputs "
                             f"across the ranks of a grid) or False")
        if self.timeout is not None and not (_number(self.timeout) and self.timeout > 0):
            raise UsageError(f"timeout={self.timeout!r}: expected a positive number of seconds, or None for the "
                             f"process group's own timeout")
        if not isinstance(self.compile, bool):
            raise UsageError(f"compile={self.compile!r}: expected True (run each rank's program under "
                             f"torch.compile) or False (eager)")
        if not (self.recompute is None or self.recompute is False or self.recompute in RECOMPUTE_MODES):
            raise UsageError(f"recompute={self.recompute!r}: expected None (keep every activation for backward; "
                             f"strategy='auto' may recompute blocks to fit memory_limit), False (never recompute), "
                             f"'blocks' (keep each repeated block's inputs, run the block again in backward) or "
                             f"'selective' (keep matmul and communication outputs, recompute the local ops "
                             f"between them)")
        if isinstance(self.optimizer_states, bool) or not isinstance(self.optimizer_states, int) \
                or self.optimizer_states < 0:
            raise UsageError(f"optimizer_states={self.optimizer_states!r}: expected the number of tensors the "
                             f"optimizer keeps per parameter (AdamW: 2, SGD with momentum: 1, plain SGD: 0)")

        if not isinstance(self.forward_only, bool):
            raise UsageError(f"forward_only={self.forward_only!r}: expected True (price a forward alone, as "
                             f"inference runs) or False (a training step)")

        if not (_number(self.grad_bucket_mb) and self.grad_bucket_mb >= 0):
            raise UsageError(f"grad_bucket_mb={self.grad_bucket_mb!r}: expected MiB >= 0 of parameter gradients "
                             f"per data-parallel all-reduce (default {BUCKET_MB:g}; 0: one all-reduce per "
                             f"parameter block)")

    def items(self) -> list:
        """(name, value) of every option, in declaration order (what ranks compare before compiling)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise UsageError(f"{name}={value!r}: expected one of {allowed}; pass one of these, or leave {name} out "
                         f"for the default {allowed[0]!r}")


DEFAULTS = Options()  # the keyword defaults of parallelize, plan and choose_grid
