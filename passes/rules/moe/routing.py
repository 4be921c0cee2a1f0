"""Rules and costs of the routed region's ops (`passes.ops.moe_dispatch`): expert parallelism with the
tokens split over the grid's rows.

    h    [T, H]   S(0)S(1)   ids, w [Tk] S(0)R     (the router's own layouts: its top-k ran per row)
    moe_offsets(ids)          -> offs [E]    RR             all-reduce of E counts over the rows
    moe_dispatch(h, ids)      -> x [Tk, H]   P(rows)R       all-to-all over the rows of [H/C] blocks,
                                                            all-gather over the columns of the run
    (grouped matmuls, activation: `passes.rules.moe.experts`, P(rows) throughout)
    moe_combine(y, w, ids)    -> [T, H]      S(0)S(1)       reduce-scatter over the columns of the run,
                                                            all-to-all back over the rows

The scheme sends each routed pair's hidden block [H/C] between rows (the columns each move their own
block, C times less than a whole row) and all-gathers H over the columns only for the pairs of this
row's experts, since the first expert matmul splits each expert's intermediate dim over the columns
and so reads H whole; a column product on x's blocks instead would leave [n, 2I] partial sums, larger.

Sizes depend on the routing. The costs assume it balanced: each row sends (R-1)/R of its Tk/R pairs
away and receives as many, so its run holds Tk/R pairs (`explain` says the figure is an estimate);
the collectives count what they really move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch.distributed.tensor import Partial, Replicate, Shard

from passes.cost.volumes import all_gather_bytes, all_reduce_bytes
from passes.kernels.spec import KernelSpec, Site
from passes.layout import REPLICATED, Layout
from passes.meta import KERNEL
from passes.ops import moe_dispatch as ops
from passes.rules.registry import Strategy, Unsupported, register_named
from passes.nodes import shape
from passes.rules.moe.expert_rows import EXPERT_ROWS

OFFSETS, DISPATCH = "autopar.moe_offsets.default", "autopar.moe_dispatch.default"
COMBINE = "autopar.moe_combine.default"
BALANCED = "estimate: routing taken as balanced"
_PAIRS = Layout((Shard(0), Replicate()))  # ids and weights [Tk]: this row's pairs, whole over the columns
_TOKENS = Layout((Shard(0), Shard(1)))  # h [T, H] and the combined result


def _div(a, b, exact: bool):
    return a / b if exact else a // b


def _moved(v: dict, exact: bool) -> tuple:
    """(bytes of the all-to-all, of the column collective, of the counts' all-gather) one rank receives
    in one direction: Tk/R pairs per row, (R-1)/R of them from other rows, [H/C] blocks of e bytes."""
    run = _div(v["s"], v["R"], exact)  # pairs in this row's run
    block = _div(v["h"] * v["e"], v["C"], exact)  # bytes of one pair's [H/C] block
    a2a = _div(run * (v["R"] - 1), v["R"], exact) * block
    # a combine's reduce-scatter of the [run, H] sums receives what a dispatch's all-gather does
    return a2a, all_gather_bytes(run * block, v["C"]), all_gather_bytes(8 * v["x"], v["R"])


@dataclass(frozen=True)
class RoutedSpec(KernelSpec):
    """Dispatch or combine (`ExpertDispatch` / `ExpertCombine`): the same collectives, transposed."""

    k: int = 1
    experts: int = 1
    combine: bool = False
    name: ClassVar[str] = "moe"

    def operands(self, node):
        return tuple(node.args[:3] if self.combine else node.args[:2])

    def build(self, node, grid, lowering):
        cls = ops.ExpertCombine if self.combine else ops.ExpertDispatch
        return cls(grid, self.k, self.experts, f"moe:{node.name}"), self.operands(node)

    def values(self, site: Site) -> dict:
        pairs = shape(site.args[2 if self.combine else 1])[0]
        x = site.args[0]
        return {"R": site.mesh[0], "C": site.mesh[1], "e": x.meta["val"].element_size(), "s": pairs,
                "h": shape(x)[-1], "x": self.experts}

    def steps(self, site, v, exact):
        a2a, cols, counts = _moved(v, exact)
        there = [(0, "fwd", counts), (0, "fwd", a2a), (1, "fwd", cols)]
        grad = site.grads[0]
        back = [(1, "bwd", cols), (0, "bwd", a2a)] if grad else []
        return there + back

    def describe(self, site):
        what = "reduce-scatter (row), all-to-all (col)" if self.combine else "all-to-all (col), all-gather (row)"
        return f"{what}; bwd transposed; {BALANCED}"



@dataclass(frozen=True)
class OffsetsSpec(KernelSpec):
    """The grouped matmul's offsets from every row's counts (`ExpertOffsets`)."""

    experts: int = 1
    name: ClassVar[str] = "moe_offsets"

    def operands(self, node):
        return (node.args[0],)

    def build(self, node, grid, lowering):
        return ops.ExpertOffsets(grid, self.experts, f"moe:{node.name}"), self.operands(node)

    def values(self, site):
        return {"R": site.mesh[0], "x": self.experts}

    def steps(self, site, v, exact):
        return [(0, "fwd", all_reduce_bytes(8 * v["x"], v["R"], exact))]

    def describe(self, site):
        return "all-reduce (col) of the expert counts"


def _pairs_split(node, mesh) -> None:
    if shape(node)[0] % mesh[0]:
        raise Unsupported(f"{shape(node)[0]} routed pairs on {mesh[0]} rows: the rows must divide the tokens")


@register_named(OFFSETS)
def offsets(node, layouts, mesh):
    ids, experts = node.args[0], node.args[1]
    if mesh[0] == 1:
        return Strategy({ids: REPLICATED}, REPLICATED)
    _pairs_split(ids, mesh)
    return Strategy({ids: _PAIRS}, REPLICATED, kernel=OffsetsSpec(experts=experts), note="expert counts")


@register_named(DISPATCH)
def dispatch(node, layouts, mesh):
    h, ids, k, experts = node.args
    if mesh[0] == 1:
        raise Unsupported("one grid row: no tokens to exchange between rows")
    _pairs_split(ids, mesh)
    if shape(h)[-1] % mesh[1] or shape(h)[0] % mesh[0]:
        raise Unsupported(f"tokens {shape(h)} on a {tuple(mesh)} grid: the rows must divide the tokens and the "
                          f"columns the hidden dim")
    spec = RoutedSpec(k=k, experts=experts)
    return Strategy({h: _TOKENS, ids: _PAIRS}, Layout((EXPERT_ROWS, Replicate())), kernel=spec,
                    note=f"tokens to their experts' rows; {BALANCED}")


@register_named(COMBINE)
def combine(node, layouts, mesh):
    y, w, ids, k, experts = node.args
    if mesh[0] == 1:
        raise Unsupported("one grid row: no tokens to exchange between rows")
    _pairs_split(ids, mesh)
    if shape(y)[-1] % mesh[1]:
        raise Unsupported(f"hidden dim {shape(y)[-1]} on {mesh[1]} columns")
    cols = Partial("sum") if mesh[1] > 1 else Replicate()
    spec = RoutedSpec(k=k, experts=experts, combine=True)
    return Strategy({y: Layout((EXPERT_ROWS, cols)), w: _PAIRS, ids: _PAIRS}, _TOKENS, kernel=spec,
                    note=f"results back to their tokens' rows; {BALANCED}")


def grad_summed(node) -> bool:
    """Whether `node`'s value is a dispatch, whose kernel sums its gradient over the columns itself
    (the reduce-scatter of its backward): no GradSync of it over the columns."""
    spec = node.meta.get(KERNEL)
    return str(node.target) == DISPATCH or (isinstance(spec, RoutedSpec) and not spec.combine)

