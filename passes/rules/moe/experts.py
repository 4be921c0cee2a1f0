"""Mixture-of-experts: transformers' grouped expert matmul with the experts split over the grid.

transformers 5 keeps a layer's experts as 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) and runs them, under capture, as `torch.ops.transformers.grouped_mm_fallback(x [S, K]
sorted by expert, w [E, K, N], offs [E])`, with the routing (top-k, sort, gather of the tokens) as
plain aten ops around it. The layouts, for an R x C grid:

- the weights: experts over the R rows, each expert's intermediate dim over the C columns
  (gate_up [E, H, 2I] is `S(0)S(2)x2`, interleaved so that each column's gate and up halves match;
  down [E, I, H] is `S(0)S(1)`): a rank holds 1/(RC) of every expert layer;
- the routed tokens x [S, H] arrive whole (the routing ops run whole, with the fallback's warning);
  row r multiplies only the run of x that its experts own (`passes.ops.experts.ExpertBlockMM`) and
  leaves the other rows zero. That is a partial sum over the rows in which each row comes from one
  member: the placement `EXPERT_ROWS`, printed `P(rows)`;
- `act(gate) * up` and casts keep `P(rows)` (an op that maps 0 to 0, or a product with a factor that
  is itself `P(rows)` or whole over the rows, leaves the other rows zero), so the down projection
  reads its own rows only; over the columns it sums the I blocks: its output is `P(rows)P(sum)`,
  reduced where the combine needs it whole.

An expert count R does not divide is split in torch.chunk blocks (indivisible='uneven'); otherwise
the experts stay whole over the rows and the rule says so in `explain`. A local gradient on a
`P(rows)` tensor is only read on this member's rows: every op that keeps the placement is elementwise
over rows, and the grouped matmul that made it drops the rest.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from passes.kernels.spec import KernelSpec, Site, products_per_step
from passes.layout import REPLICATED, Layout, Strided, split_dim, uneven_ok
from passes.ops.experts import ExpertBlockMM
from passes.rules.registry import Strategy, Unsupported, register, register_named
from passes.nodes import arg, shape, tensor_inputs
from passes.rules.moe.expert_rows import ZERO_KEEPING, EXPERT_ROWS
from passes.rules.weights import fused_parts, whole_experts_why

aten = torch.ops.aten
_BETWEEN = ZERO_KEEPING | {aten.chunk, aten.split, aten.split_with_sizes}  # ops between two expert matmuls
GROUPED_MM = "transformers.grouped_mm_fallback.default"


@dataclass(frozen=True)
class ExpertsSpec(KernelSpec):
    """The grouped matmul on this rank's experts (`ExpertBlockMM`): no communication of its own."""

    name: ClassVar[str] = "experts"
    local: ClassVar[bool] = True
    experts: int = 1
    split: bool = False  # the experts are split over the rows
    aten: bool = False  # torch's aten._grouped_mm, else transformers' fallback op

    def operands(self, node):
        return node.args[0], node.args[1], arg(node, 2, "offs")

    def build(self, node, grid, lowering):
        return ExpertBlockMM(grid, self.experts, self.split, self.aten), self.operands(node)

    def describe(self, site):
        return f"grouped matmul, {self.experts} experts" + (" over the rows" if self.split else "")

    def flops(self, site: Site) -> int:
        """2 S K N per product over this rank's blocks, S / R rows when the experts are split (the
        routing spread evenly: the real count depends on the tokens)."""
        s, k = site.local(0)
        n = site.local(1)[-1]
        rows = math.ceil(s / site.mesh[0]) if self.split else s
        return 2 * rows * k * n * products_per_step(*site.grads[:2])


def is_grouped_mm(node: Node) -> bool:
    return node.target == aten._grouped_mm.default or str(node.target) == GROUPED_MM


def _source_mm(x: Node) -> Node | None:
    """The grouped matmul whose output x is, through casts, activations, products and the split into
    gate and up (what lies between two expert matmuls); None when x is not such a value."""
    while x.op == "call_function" and not is_grouped_mm(x):
        packet = getattr(x.target, "overloadpacket", None)
        if x.target is not operator.getitem and packet not in _BETWEEN:
            return None
        ins = tensor_inputs(x)
        if not ins:
            return None
        x = ins[0]
    return x if x.op == "call_function" else None


def reads_first_matmul(node: Node, x: Node) -> bool:
    """x is the result of a grouped matmul over the same experts and offsets as `node` (the down
    projection reading the gate/up projection's output)."""
    src = _source_mm(x)
    return src is not None and arg(src, 2, "offs") is arg(node, 2, "offs") and \
        shape(src.args[1])[0] == shape(node.args[1])[0]


def _columns(node: Node, x_lay: Layout, second: bool, w_shape: tuple, mesh) -> tuple:
    """(x's, w's and the output's placement over the columns): the second matmul splits K as its input
    arrives split, the first splits N (interleaved when its output is cut into equal parts) and reads
    x whole over the columns, so that the activation between them runs on its blocks."""
    _, K, N = w_shape
    C = mesh[1]
    px = x_lay[1]
    if C > 1 and second and split_dim(px) == 1 and not isinstance(px, Strided) and (K % C == 0 or uneven_ok(mesh)):
        return Shard(1), Shard(1), Partial("sum")
    k = fused_parts(node)
    if C > 1 and N % (C * k) == 0:
        return Replicate(), (Strided(2, split_factor=k) if k > 1 else Shard(2)), \
            (Strided(1, split_factor=k) if k > 1 else Shard(1))
    if C > 1 and k == 1 and uneven_ok(mesh):
        return Replicate(), Shard(2), Shard(1)
    return Replicate(), Replicate(), Replicate()


@register(aten._grouped_mm.default)
def aten_grouped_mm(node, layouts, mesh):
    """torch's grouped matmul (what transformers calls with bf16 weights): the same split as its
    fallback when it has offsets and neither a bias nor another output dtype."""
    if arg(node, 2, "offs") is None or arg(node, 3, "bias") is not None or arg(node, 4, "out_dtype") is not None:
        raise Unsupported("_grouped_mm without offsets, or with a bias or an out_dtype")
    return grouped_mm(node, layouts, mesh)


@register_named(GROUPED_MM)
def grouped_mm(node, layouts, mesh):
    x, w, offs = node.args[0], node.args[1], arg(node, 2, "offs")
    ws = shape(w)
    if len(ws) != 3 or len(shape(x)) != 2:
        raise Unsupported(f"grouped matmul of x {shape(x)} and w {ws}: expected x [S, K], w [E, K, N]")
    have = (layouts.get(x) or REPLICATED).normalized(2)
    placed = layouts.get(w)
    E, R = ws[0], mesh[0]
    split = R > 1 and (E % R == 0 or uneven_ok(mesh))
    if placed is not None:  # pinned by an earlier compile (another input shape): keep its expert blocks
        split = placed[0] == Shard(0)
    second = reads_first_matmul(node, x)
    x1, w1, o1 = _columns(node, have, second, ws, mesh)
    # the first matmul reads x P(rows) too when the dispatch sent each row its experts' tokens
    x0 = EXPERT_ROWS if split and have[0] == EXPERT_ROWS else Replicate()
    w0, o0 = (Shard(0), EXPERT_ROWS) if split else (Replicate(), Replicate())
    need = {x: Layout((x0, x1)), w: Layout((w0, w1)), offs: REPLICATED}
    spec = ExpertsSpec(experts=E, split=split, aten=node.target == aten._grouped_mm.default)
    if split or R == 1:
        return Strategy(need, Layout((o0, o1)), kernel=spec, note="experts over the rows" if split else "")
    # the experts whole on every row: correct, but each rank stores R times its share -- say so
    return Strategy(need, Layout((o0, o1)), kernel=spec, fallback=True, note=whole_experts_why(w, E, R, placed))
