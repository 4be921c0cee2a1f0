"""A plan per generation phase: which strategy plans prefill and decode, what each is estimated to cost
as a forward alone, and the parameter copies a phase laid out otherwise keeps across calls.

Prefill multiplies [B*P, h] activations by every weight, decode [B, h]: with few tokens SUMMA moves
weight panels for tiny activations, and a 1D or replicated weight is cheaper. So each phase is planned
on its own when the model's strategy asks for it. `pmodel.generate(prefill_strategy=, decode_strategy=)`:

    None      (default) follow the model: one parallelized with strategy='auto' plans each phase with
              the search; one parallelized '2d' or '1d' runs the forward's plan on its stored blocks
    'forward' the forward's plan, whatever the model's strategy
    '2d', '1d', 'auto'  that strategy for this phase alone

A phase's own plan is priced as what inference runs (`Options.forward_only`): the forward alone, no
backward products, no gradient reductions, nothing saved, parameters without gradients or optimizer
states. A parameter that plan lays out otherwise than stored is read from a copy (`Relaid`), made on
first use, kept across generate calls and made again only when the parameter changed (its version
counters moved: an optimizer step, `load_state_dict`, any in-place write; its bits changed: a write
through `.data`) or was replaced. The check runs at the start of each generate call on every rank and
its verdicts are combined (a copy stale on one rank is stale on all), so every rank refreshes the same
copies, in the programs' placeholder order (each copy is a collective).
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.distributed as dist

from autopar.program.build import resolve_cost_model
from autopar.program.guards import bit_sum
from passes.search import strategy as strategies
from passes.search.estimate import Estimate
from passes.layout import Layout
from passes.options import format_bytes
from passes.ops import comm
from passes.ops import modules as kernels
from autopar.errors import MemoryLimitError, UsageError

__all__ = ["PHASE_STRATEGIES", "PhasePlan", "Relaid", "phase_strategy", "phase_options", "stored_bytes",
           "estimate_phase", "phase_plan"]

PHASE_STRATEGIES = (None, "forward", "2d", "1d", "auto")


def phase_strategy(pmodel, name: str, value) -> str | None:
    """The strategy that plans phase `name` ('prefill_strategy' / 'decode_strategy') for the value the
    user passed: '2d', '1d' or 'auto' (its own plan) or None (the forward's plan), per the table above."""
    if value not in PHASE_STRATEGIES:
        raise UsageError(f"pmodel.generate: {name}={value!r}: expected None (follow the model's strategy: 'auto' "
                         f"plans each phase on its own, '2d' and '1d' keep the forward's plan), 'forward' (the "
                         f"forward's plan), '2d', '1d' or 'auto' (that strategy for this phase alone)")
    if value is None:
        return "auto" if pmodel.options.strategy == "auto" and pmodel.grid.world > 1 else None
    return None if value == "forward" else value


def phase_options(options, strategy: str | None, stored_bytes: int = 0):
    """The Options a phase compiles with: its strategy (None: the forward's), priced as a forward alone.
    A phase's own search under `memory_limit` counts the parameter blocks the rank stores beside it
    (`stored_bytes`): its plan must fit the limit less those (an upper bound on what the phase adds, as a
    parameter its plan keeps in the stored layout is counted twice).

    >>> from passes.options import Options
    >>> phase_options(Options(strategy="auto", memory_limit=1000), "auto", stored_bytes=300).memory_limit
    700
    >>> phase_options(Options(strategy="auto"), "auto", stored_bytes=300).memory_limit is None
    True
    """
    over: dict = {"strategy": strategy} if strategy else {}
    limit = options.memory_limit_bytes
    if strategy == "auto" and limit is not None:
        if limit <= stored_bytes:
            raise MemoryLimitError(
                f"pmodel.generate: memory_limit={format_bytes(limit)} per rank leaves nothing for a phase's "
                f"own plan beside the {format_bytes(stored_bytes)} of parameter blocks this rank stores. Pass "
                f"prefill_strategy='forward' and decode_strategy='forward' (the forward's plan, no copies) or a "
                f"larger memory_limit.")
        over["memory_limit"] = limit - stored_bytes
    return dataclasses.replace(options, forward_only=True, context_parallel=1, **over)  # whole sequence: see loop


def stored_bytes(pmodel) -> int:
    """Bytes of the parameter blocks this rank stores (local blocks of DTensors, else the tensors)."""
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in pmodel.parameters())


def estimate_phase(pmodel, gm, strategy: str | None) -> Estimate | None:
    """The forward-only estimate of a fixed plan for phase graph `gm` (captured, not yet propagated):
    strategy '2d' or '1d', or None (the forward's plan: its strategy, or its search's assignment),
    SUMMA products at the lowering they will run. None for 'auto' (its search's estimate is the plan's),
    on one rank, and for a forward's assignment that does not name every unit of `gm`. Leaves the
    plan's `CHOICE` marks on `gm`, as the compile that follows sets them."""
    options, grid = pmodel.options, pmodel.grid
    if grid.world == 1 or strategy == "auto":
        return None
    cm = resolve_cost_model(options.cost_model)
    forward = phase_options(options, strategy)
    if strategy is None and options.strategy == "auto":
        choice = pmodel.choice
        keys = {u.key for u in strategies.find_units(gm)}
        if choice is None or not keys <= set(choice.assignment):
            return None
        return strategies.estimate_assignment(gm, grid.shape, cm, {k: choice.assignment[k] for k in keys}, forward)
    return strategies.estimate_fixed(gm, grid.shape, cm, strategy or options.strategy, forward,
                                      options.fixed_lowering)


@dataclasses.dataclass
class PhasePlan:
    """How one generation program was planned, for `explain`."""

    strategy: str  # '2d', '1d' or 'auto'
    own: bool  # planned for this phase (False: the forward's plan)
    estimate: Estimate | None  # forward alone, on one rank (None: on one rank, or not priced)
    lowerings: dict  # SUMMA lowering -> products of the compiled program that run it
    assignment: dict  # strategy 'auto': unit key -> option

    def describe(self) -> str:
        """'auto (this phase's own): <assignment>; est. forward 1.234 ms; SUMMA lowering broadcast x8'."""
        whose = "this phase's own" if self.own else "the forward's plan"
        text = f"{self.strategy} ({whose})"
        if self.assignment:
            text += ": " + "; ".join(f"{k}: {v}" for k, v in self.assignment.items())
        if self.estimate is not None:
            text += f"; estimated forward {self.estimate.time_s * 1e3:.3f} ms"
        lows = ", ".join(f"{lo} x{n}" for lo, n in sorted(self.lowerings.items()))
        return text + (f"; SUMMA lowering {lows}" if lows else "; no SUMMA product")


def phase_plan(pmodel, strategy: str | None, comp, estimate: Estimate | None) -> PhasePlan:
    """The PhasePlan of a compiled generation program (`strategy` as `phase_strategy` resolved it)."""
    lowerings = collections.Counter(m.lowering for m in comp.gm.modules() if isinstance(m, kernels.SummaLinear))
    own = strategy is not None
    searched = comp.choice is not None and own
    return PhasePlan(strategy or pmodel.options.strategy, own,
                     comp.choice.estimate if searched else estimate, dict(lowerings),
                     dict(comp.choice.assignment) if searched else {})


def _stamp(p) -> tuple:
    """What changes when parameter `p` is written or replaced: its identity, version counters (the
    DTensor's and its local block's: an optimizer may write either), its block's storage, and a
    checksum of the block's bits, which a write through `.data` (that moves no version counter) changes."""
    local = p.to_local()
    return id(p), p._version, local._version, local.data_ptr(), bit_sum(local)


class Relaid:
    """Parameter blocks laid out for a phase's own plan, kept across generate calls."""

    def __init__(self):
        self.blocks: dict = {}  # (parameter name, Layout) -> (stamp of the parameter copied, this rank's block)
        self.copies = 0  # copies made so far (a refresh counts)

    def begin(self, pmodel) -> None:
        """At the start of a generate call: drop the copies whose parameter changed since it was copied
        on any rank of the grid (one all-reduce of a flag per copy), so that every rank makes the same
        copies again (each is a collective) and none reads weights older than the parameters."""
        if not self.blocks:
            return
        keys = list(self.blocks)
        stale = torch.tensor([float(self.blocks[k][0] != _stamp(pmodel.get_parameter(k[0]))) for k in keys],
                             device=pmodel.program.captured.device)
        grid = pmodel.grid
        if grid.world > 1:
            with comm.guarded(grid, "generate weight-copy check all-reduce", "grid", "generate"):
                dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=grid.world_group)
        for k, flag in zip(keys, stale.tolist()):
            if flag:
                del self.blocks[k]

    def get(self, name: str, p, layout: Layout) -> torch.Tensor:
        """This rank's block of parameter `p` (a DTensor) in `layout`: the copy held (checked by
        `begin`), else a new one."""
        held = self.blocks.get((name, layout))
        if held is None:
            block = p.detach().redistribute(p.device_mesh, list(layout.placements)).to_local()
            held = self.blocks[(name, layout)] = (_stamp(p), block)
            self.copies += 1
        return held[1]

    def __len__(self) -> int:
        return len(self.blocks)

    def nbytes(self) -> int:
        """Bytes of the copies this rank holds."""
        return sum(t.numel() * t.element_size() for _, t in self.blocks.values())
