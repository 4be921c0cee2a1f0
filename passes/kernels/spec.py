"""What an inserted module is and what it costs, in one place: one `KernelSpec` per kind of module.

A rule that needs a kernel names it in its Strategy with a typed spec (`SummaSpec(x=..., w=...,
bias=..., transposed=..., flip=...)` here; `NormSpec`, `ConvSpec`, `EmbeddingSpec`, `CrossEntropySpec`
and the other specs of ops run on their blocks in `passes.kernels.local`); the insertion
pass adds a `RedistributeSpec` where an input must change layout and a `GradSyncSpec` where its
gradient must be summed, and records every inserted node's spec in `node.meta[KERNEL]`.
Everything that needs to know about an inserted module asks its spec:

- the insertion pass: `build(node, grid, lowering)`, the nn.Module and its (unrouted) arguments;
- `passes.cost.planned` / `explain`: `cost(site)`, the bytes received per rank as sympy formulas;
- `passes.search.estimate`: `terms(site)`, the same bytes as numbers, one launch per collective call;
- both: `flops(site, spec)`, the one count of matmul work (kernels and local ops alike).

A spec's bytes are its `steps`: (mesh axis, phase, bytes) of each collective call it makes, written
once over values that are sympy symbols (the formulas) or numbers (the estimate). A `Site` holds the
facts they read, from the graph before insertion (`Site.planned`) or after it (`Site.inserted`).

"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import sympy
import torch
from torch.fx import Node

from passes.cost.planned import (C, E, R, Cost, redistribute_steps, redistribution, summa_ab_bytes, summa_abt_bytes,
                                  summa_axis_elems)
from passes.cost.volumes import all_reduce_bytes
from passes.layout import Layout, local_shape, mesh_shape
from passes.mesh import Grid
from passes.meta import LAYOUT, LOWERING
from passes.ops import reblock
from passes.ops import modules as kernels
from passes.cost.rotation import product_calls
from passes.cost.summa_blocks import product_elems, step_products


aten = torch.ops.aten
MATMULS = {aten.linear.default: (0, 1), aten.addmm.default: (1, 2), aten.mm.default: (0, 1),
           aten.matmul.default: (0, 1)}  # matmul-like op -> (activation arg, weight arg)
SDPA = aten.scaled_dot_product_attention.default
# local ops whose FLOPs are counted -> their operand args (q, k, v for attention)
_OPERANDS = {**MATMULS, aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2), SDPA: (0, 1, 2)}
_SYMBOLS = {"R": R, "C": C, "e": E}  # the grid and element-size symbols `passes.cost.planned` shares


def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol a value named `name` stands for in a formula."""
    return _SYMBOLS.get(name) or sympy.Symbol(name, positive=True)


def operands(node: Node) -> tuple:
    """The operands of a local matmul-like op (or attention) whose FLOPs count; () for other ops."""
    idx = _OPERANDS.get(node.target, ()) if node.op == "call_function" else ()
    return tuple(node.args[i] for i in idx)


@dataclass(frozen=True)
class Site:
    """One node as its costs see it: its tensor operands `args` (a kernel's in its argument order),
    the layout each arrives in, the output's layout `out`, the grid (R, C), and whether each operand
    needs a gradient. `planned` reads them before insertion (layouts as the rule asks), `inserted`
    from the rewritten graph, so the estimate and `explain` count the same. `at`: the grid position
    (r, c) whose blocks are priced where the grid does not divide a dim (torch.chunk blocks differ
    per rank); (0, 0), which holds the largest blocks, unless a caller asks for another."""

    node: Node
    args: tuple
    layouts: tuple
    out: Layout | tuple | None  # the output's layout (a tuple for multi-output ops, which no kernel has; None: none)
    mesh: tuple
    grads: tuple
    at: tuple = (0, 0)

    @classmethod
    def planned(cls, node: Node, strat: Any, layouts: dict, mesh, grads: set, at: tuple = (0, 0)) -> Site:
        args = strat.kernel.operands(node) if strat.kernel is not None else operands(node)
        return cls(node, args, tuple(strat.inputs.get(a, layouts.get(a)) for a in args), strat.output,
                   mesh_shape(mesh), tuple(a in grads for a in args), tuple(at))

    @classmethod
    def inserted(cls, node: Node, mesh, grads: set, at: tuple = (0, 0)) -> Site:
        args = tuple(node.args) if node.op == "call_module" else operands(node)
        lays = tuple(a.meta.get(LAYOUT) if isinstance(a, Node) else None for a in args)
        out = node.meta.get(LAYOUT)
        return cls(node, args, lays, out, mesh_shape(mesh), tuple(a in grads for a in args), tuple(at))

    def val(self, i: int) -> torch.Tensor:
        return self.args[i].meta["val"]

    def local(self, i: int) -> tuple:
        """The block of operand i a rank holds as it arrives."""
        return local_shape(tuple(self.val(i).shape), self.layouts[i], self.mesh, self.args[i].name, at=self.at)

    def local_out(self) -> tuple:
        return local_shape(tuple(self.node.meta["val"].shape), cast(Layout, self.out), self.mesh, self.node.name,
                           at=self.at)


class KernelSpec:
    """One kind of inserted module (subclasses are frozen dataclasses of what the rule or the pass
    decided). `name` makes the graph's module names, autopar_<name>_<node>. Bytes are received per
    rank, with the conventions of `passes.mesh.CommLog`."""

    name: ClassVar[str]
    local: ClassVar[bool] = False  # its module runs on the blocks alone (reads grid.shape, r, c; no collective)

    def operands(self, node: Node) -> tuple:
        """The kernel's tensor arguments in the graph before insertion, in `build`'s order."""
        return tuple(node.args[:2])

    def build(self, node: Node, grid: Grid, lowering: str) -> tuple:
        """(nn.Module, args) that replace `node` on every rank; args before routing."""
        raise NotImplementedError(f"{type(self).__name__} does not build a module")

    def values(self, site: Site) -> dict:
        """Symbol name -> number: the sizes the bytes depend on, in the order `explain` prints them."""
        return {}

    def steps(self, site: Site, v: dict, exact: bool) -> list:
        """(mesh axis, "fwd" | "bwd", bytes) of each collective call, over `v`: sympy symbols with
        `exact`, else numbers (integer division, as the collective layer counts)."""
        return []

    def describe(self, site: Site) -> str:
        """The collectives it runs, as `explain`'s column names them."""
        return ""

    def cost(self, site: Site) -> Cost:
        """The bytes as formulas with the values they take here (what `explain --formulas` prints)."""
        values = self.values(site)
        steps = self.steps(site, {k: symbol(k) for k in values}, exact=True)
        fwd = sum((b for _, phase, b in steps if phase == "fwd"), sympy.Integer(0))
        bwd = sum((b for _, phase, b in steps if phase == "bwd"), sympy.Integer(0))
        return Cost(self.describe(site), fwd, bwd, {symbol(k): n for k, n in values.items()})

    def inserted_cost(self, node: Node, mesh, grads: set, at: tuple = (0, 0)) -> Cost:
        """`cost` of `node`, a module of the rewritten graph this spec describes, at grid position `at`."""
        return self.cost(Site.inserted(node, mesh, grads, at))

    def calls(self, site: Site, *, lowering: str) -> tuple:
        """Collective calls this rank launches in one training step, (forward, backward): one per
        step on an axis with more than one member (`passes.mesh.CommLog` counts the same). `lowering`:
        the one a SUMMA product's module runs ('broadcast', 'allgather' or 'ring')."""
        steps = self.steps(site, self.values(site), exact=False)
        return tuple(sum(1 for a, ph, _ in steps if ph == phase and site.mesh[a] > 1) for phase in ("fwd", "bwd"))

    def inserted_calls(self, node: Node, mesh, grads: set, *, lowering: str, at: tuple = (0, 0)) -> tuple:
        """`calls` of `node`, a module of the rewritten graph this spec describes, at grid position `at`."""
        return self.calls(Site.inserted(node, mesh, grads, at), lowering=lowering)

    def terms(self, site: Site) -> list:
        """(axis, bytes, launches) of each collective call that moves data (axes of one member left out)."""
        return [(a, b, 1) for a, _, b in self.steps(site, self.values(site), exact=False) if site.mesh[a] > 1]

    def flops(self, site: Site) -> int:
        return 0


def products_per_step(*needs_grad: bool) -> int:
    """Products one matmul runs in a training step: the forward one, and one backward per operand
    that needs a gradient (dX = dY W^T, dW = X^T dY)."""
    return 1 + sum(needs_grad)


@dataclass(frozen=True)
class SummaSpec(KernelSpec):
    """A linear x [..., K] . W (+ bias) as a SUMMA product (`kernels.SummaLinear`); W stored [K, N]
    (AB) or [N, K] (ABT, `transposed`); `flip` when the local block must be transposed first;
    `rows_whole` when x is not split over the mesh rows (a batch they do not divide): every row then
    computes all M rows, priced here as a product of R times M rows (an upper bound: the weight
    gradient's reduce over the rows is skipped)."""

    x: Node
    w: Node
    bias: Node | None
    transposed: bool
    flip: bool
    rows_whole: bool = False
    grouped: str = ""  # "lead" / "follow": runs in one `summa_group.SummaGroup` with its siblings
    name: ClassVar[str] = "summa"

    def operands(self, node: Node) -> tuple:
        return (self.x, self.w) + ((self.bias,) if self.bias is not None else ())

    def build(self, node, grid, lowering):
        lowering = node.meta.get(LOWERING, lowering)  # strategy='auto' picks one per product
        cut = node.meta["val"].shape[-1] if self.transposed else self.x.meta["val"].shape[-1]  # N for ABT, K for AB
        full = cut if cut % grid.shape[0] or cut % grid.shape[1] else None  # torch.chunk blocks of that dim
        return (kernels.SummaLinear(grid, self.transposed, self.flip, node.name, lowering, self.rows_whole, full),
                self.operands(node))

    def values(self, site):
        x, y = site.val(0), site.node.meta["val"]
        rows = math.prod(x.shape[:-1]) * (site.mesh[0] if self.rows_whole else 1)
        return {"R": site.mesh[0], "C": site.mesh[1], "e": y.element_size(), "M": rows,
                "K": x.shape[-1], "N": y.shape[-1]}

    def products(self, site: Site) -> int:
        return products_per_step(site.grads[0], site.grads[1])

    def describe(self, site):
        if self.lowering(site.node) == "allgather":
            return ("SUMMA ABT: gather W (col), scatter-sum Y (row); bwd AB+ATB" if self.transposed
                    else "SUMMA AB: gather X (row), W (col); bwd ABT + ATB")
        if self.lowering(site.node) == "ring":
            return ("SUMMA ABT ring: W pieces p2p (col), partial Y p2p (row); bwd AB + ATB" if self.transposed
                    else "SUMMA AB ring: X pieces p2p (row), W pieces p2p (col); bwd ABT + ATB")
        return ("SUMMA ABT: bcast W (col), reduce Y (row); bwd AB + ATB" if self.transposed
                else "SUMMA AB: bcast X (row), W (col); bwd ABT + ATB")

    @staticmethod
    def lowering(node) -> str:
        """The lowering the product runs: its module's once inserted, else the one marked on it."""
        if node.op == "call_module":
            return getattr(node.graph.owning_module.get_submodule(node.target), "lowering", "broadcast")
        return node.meta.get(LOWERING, "broadcast")

    def cost(self, site):
        """Each product receives the same bytes; written as one fraction per product (`summa_ab_bytes`).
        A grouped follower receives only its weight's (the lead gathers x and reduces dX for all). With K or
        N in unequal torch.chunk blocks, the site's rank's exact bytes (`_rank_steps`)."""
        if self._unequal(site):
            return super().cost(site)
        values = self.values(site)
        M, K, N = (symbol(k) for k in "MKN")
        fwd, bwd = (summa_abt_bytes if self.transposed else summa_ab_bytes)(M, K, N, self.products(site) - 1)
        if self.grouped == "follow":
            fwd = E * summa_axis_elems(M, K, N, R, C, False)[0] / (R * C)
            bwd = (self.products(site) - 1) * fwd
        return Cost(self.describe(site), fwd, bwd, {symbol(k): n for k, n in values.items()})

    def _per_axis(self, v: dict) -> list:
        elems = summa_axis_elems(v["M"], v["K"], v["N"], v["R"], v["C"], self.transposed)
        if self.grouped == "follow":  # x's panel and dX's partial sums (axis 1) move once, for the lead
            elems = (elems[0], 0)
        return [n * v["e"] / (v["R"] * v["C"]) for n in elems]

    def axis_bytes(self, site: Site) -> list:
        """Bytes one product receives over mesh axis 0 and over axis 1 (the estimate prices each axis)."""
        return self._per_axis(self.values(site))

    def _unequal(self, site: Site) -> bool:
        """Whether the grid cuts K or N in blocks of unequal sizes: then ranks receive different bytes."""
        v = self.values(site)
        return any(v[d] % site.mesh[a] for d in "KN" for a in range(2))

    def _rank_steps(self, site: Site) -> list:
        """(axis, phase, bytes) of each product's collectives for the rank at `site.at`, as the lowering
        its module runs sends them (`passes.cost.summa_blocks`)."""
        v, node = self.values(site), site.node
        lowering = self.lowering(node)
        m = math.prod(site.local(0)[:-1])  # rows of x on this rank
        roles = {"KN": (v["K"], v["N"]), "NK": (v["N"], v["K"])}
        return [(a, phase, n * v["e"])
                for phase, kind, dims in step_products(self.transposed, *site.grads[:2])
                for a, n in product_elems(kind, lowering, site.mesh, site.at, m, *roles[dims],
                                          rows_whole=self.rows_whole)]

    def steps(self, site, v, exact):
        if self._unequal(site):
            return self._rank_steps(site)
        one = list(enumerate(self._per_axis(v)))
        return [(a, phase, b) for phase, k in (("fwd", 1), ("bwd", self.products(site) - 1))
                for _ in range(k) for a, b in one]

    def launches(self, site: Site, lowering: str) -> float:
        """Collective calls per product on each mesh axis with more than one member: the broadcast
        lowering sends one panel per step of its R + C - gcd(R, C) steps, the all-gather one call, the
        ring one point-to-point batch per step with traffic (`_ring_calls`, averaged over the axes)."""
        R_, C_ = site.mesh
        if lowering == "ring":
            calls, products = self._ring_calls(site), self.products(site)
            return sum(calls) / products / max(1, sum(1 for a in range(2) if site.mesh[a] > 1))
        return R_ + C_ - math.gcd(R_, C_) if lowering == "broadcast" else 1

    def _ring_calls(self, site: Site) -> tuple:
        """(forward, backward) point-to-point batches of the ring lowering for the rank at `site.at`
        (`passes.cost.rotation.product_calls`); ATB with `rows_whole` runs the broadcast lowering."""
        v = self.values(site)
        roles = {"KN": (v["K"], v["N"]), "NK": (v["N"], v["K"])}
        per_phase: dict = {"fwd": 0, "bwd": 0}
        for phase, kind, dims in step_products(self.transposed, *site.grads[:2]):
            if kind == "atb" and self.rows_whole:
                per_phase[phase] += sum(self.launches(site, "broadcast") for a in range(2) if site.mesh[a] > 1)
            else:
                per_phase[phase] += product_calls(kind, site.mesh, site.at, *roles[dims])
        return per_phase["fwd"], per_phase["bwd"]

    def calls(self, site, *, lowering):
        """`launches` per product and axis: the forward product, then the backward ones that run. With
        `rows_whole` an upper bound, as the bytes (the weight gradient's product sends fewer pieces).
        In a group of siblings (`passes.transforms.group_siblings`) the lead launches the group's calls, as many
        as one product's, and the others none. The ring lowering: this rank's exact count."""
        if self.grouped == "follow":
            return 0, 0
        if lowering == "ring":
            return self._ring_calls(site)
        per_product = sum(self.launches(site, lowering) for a in range(2) if site.mesh[a] > 1)
        return per_product, per_product * (self.products(site) - 1)

    def flops(self, site):
        v = self.values(site)
        return 2 * (v["M"] // v["R"]) * v["K"] * (v["N"] // v["C"]) * self.products(site)


@dataclass(frozen=True)
class RedistributeSpec(KernelSpec):
    """Move a tensor from layout `src` to `dst` (`kernels.Redistribute`); `tag` names it in the
    collective log."""

    src: Layout
    dst: Layout
    tag: str = field(default="", compare=False)
    synced: tuple = ()  # axes whose gather reduce-scatters the gradient back (a GradSync folded in)
    name: ClassVar[str] = "redist"

    def build(self, node, grid, lowering):
        v = node.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        return kernels.Redistribute(grid, self.src, self.dst, self.tag, shape, self.synced), (node,)

    def describe(self, site):
        _, names = redistribute_steps(self.src, self.dst, site.mesh, 1, 1, grad=False, synced=self.synced)
        return ", ".join(names)

    def values(self, site):
        v = site.val(0)
        n = math.prod(local_shape(tuple(v.shape), self.src, site.mesh, at=(0, 0)))  # n: elements this rank holds before
        return {"R": site.mesh[0], "C": site.mesh[1], "e": v.element_size(), "n": n}

    def steps(self, site, v, exact):
        """The steps' bytes over `v` (formulas with `exact`); where a group does not divide a dim it moves,
        the numbers of the padded blocks that move (every member's torch.chunk block padded to the
        largest), as formulas in n would leave the padding out."""
        nums = self.values(site)
        mesh, grad = (nums["R"], nums["C"]), site.grads[0]
        at = tuple(site.at)
        padded, _ = redistribute_steps(self.src, self.dst, mesh, nums["n"], nums["e"], grad, False, self.synced,
                                       tuple(site.val(0).shape), at)
        regroups = any(kind in ("regroup", "ungroup") for kind, *_ in redistribution(self.src, self.dst))
        if not exact or regroups or padded != redistribute_steps(self.src, self.dst, mesh, nums["n"], nums["e"], grad,
                                                                 False, self.synced, at=at)[0]:
            return padded  # a regroup's chunks per member are numbers of the grid's size
        return redistribute_steps(self.src, self.dst, (v["R"], v["C"]), v["n"], v["e"], grad, exact, self.synced,
                                  at=at)[0]


@dataclass(frozen=True)
class GradSyncSpec(KernelSpec):
    """All-reduce the gradient of a replicated tensor over mesh `axes` in backward (`kernels.GradSync`)."""

    axes: tuple
    tag: str = field(default="", compare=False)
    name: ClassVar[str] = "gradsync"

    def build(self, node, grid, lowering):
        return kernels.GradSync(grid, self.axes, self.tag), (node,)

    def describe(self, site):
        return f"bwd all-reduce over axes {self.axes}"

    def values(self, site):
        v = site.val(0)
        return {"R": site.mesh[0], "C": site.mesh[1], "e": v.element_size(), "n": math.prod(site.local_out())}

    def steps(self, site, v, exact):
        if not site.grads[0]:
            return []
        return [(a, "bwd", all_reduce_bytes(v["n"] * v["e"], (v["R"], v["C"])[a], exact)) for a in self.axes]


@dataclass(frozen=True)
class ReblockSpec(KernelSpec):
    """A view that merges or splits the dim split over mesh `axis` where the two sides' blocks differ
    (hidden blocks <-> head blocks, `reblock.ReblockView`): input dims `group` taken as one dim, moved
    from blocking `src` to `dst` by one all-to-all (backward the reverse), then viewed. Priced at
    the site's grid position: each member receives a different share (`reblock.received`)."""

    axis: int
    group: tuple  # the input dims the view merges (one dim when it splits one)
    src: tuple
    dst: tuple
    tag: str = field(default="", compare=False)
    name: ClassVar[str] = "reblock"

    def operands(self, node):
        return (node.args[0],)

    def build(self, node, grid, lowering):
        x, at = node.args[0], (grid.r, grid.c)
        xl = local_shape(tuple(x.meta["val"].shape), x.meta[LAYOUT], grid.shape, x.name, at=at)
        lo, hi = self.group[0], self.group[-1] + 1
        before = xl[:lo] + (math.prod(xl[lo:hi]),) + xl[hi:]
        after = local_shape(tuple(node.meta["val"].shape), node.meta[LAYOUT], grid.shape, node.name, at=at)
        return reblock.ReblockView(grid, self.axis, lo, self.src, self.dst, before, after, self.tag), (x,)

    def describe(self, site):
        return f"all-to-all {'row' if self.axis == 1 else 'col'} (blocks {self.src[1]} -> {self.dst[1]}); bwd back"

    def values(self, site):
        xl = site.local(0)
        i = site.at[self.axis]
        lo, hi = self.group[0], self.group[-1] + 1
        rest = math.prod(xl[:lo]) * math.prod(xl[hi:])  # not prod(xl) / the group's: a block may hold none of it
        return {"e": site.val(0).element_size(), "t": rest,  # t: elements of the other dims this rank holds
                "f": reblock.received(self.src, self.dst, i), "b": reblock.received(self.dst, self.src, i)}

    def steps(self, site, v, exact):
        out = [(self.axis, "fwd", v["e"] * v["t"] * v["f"])]
        return out + ([(self.axis, "bwd", v["e"] * v["t"] * v["b"])] if site.grads[0] else [])


def flops(site: Site, spec: KernelSpec | None = None) -> int:
    """Forward + backward FLOPs of one node on one rank, 2 m k n per product that runs (see
    `products_per_step`): a kernel counts its own, a local matmul-like op or attention is counted here from
    its blocks, every other op is 0. The one count `explain`, `plan` and the estimate use."""
    if spec is not None:
        return spec.flops(site)
    if site.node.op != "call_function" or site.node.target not in _OPERANDS:
        return 0
    if site.node.target == SDPA:
        return _attention_flops(site)
    y = site.node.meta.get("val")
    if not isinstance(site.layouts[0], Layout) or not isinstance(y, torch.Tensor):
        return 0
    k = site.local(0)[-1]
    out = local_shape(tuple(y.shape), cast(Layout, site.out), site.mesh, at=(0, 0))
    return 2 * math.prod(out) * k * products_per_step(*site.grads[:2])


def _attention_flops(site: Site) -> int:
    """S = Q K^T [b, h, s, sk] then O = P V; backward dQ, dK from dS, and dP (needed when Q or K
    needs a gradient), dV."""
    b, h, s, d = local_shape(tuple(site.val(0).shape), cast(Layout, site.out), site.mesh, at=(0, 0))
    sk = site.val(1).shape[-2]
    gq, gk, gv = site.grads[:3]
    return 2 * b * h * s * sk * d * (products_per_step(gq, gk) + products_per_step(gq or gk, gv))
