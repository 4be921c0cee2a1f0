"""Context parallelism in the graph: a program captured on one rank's 1/cp of the sequence made to compute
that rank's part of the whole sequence's result (the run-time parts are `passes.ops.context`'s).

`prepare` runs on the captured graph, before the layout passes:

- **Attention masks.** An attention's mask is read once, here: it must be a constant of the graph (built from
  sizes and buffers, as transformers builds its causal mask under torch.export) equal to the causal triangle
  at the captured length; the attention then runs causal by global position and the mask is dropped. A mask
  that depends on an input (padding), or any other mask, is refused by name.
- **Positions.** Every `arange` over the local length n from 0 (the model's token positions: RoPE's
  `position_ids`, a learned position table's index) becomes this rank's global positions.
- **Targets.** A mean cross-entropy's target is followed back through reshapes to the [b, n] tensor it is
  computed from the inputs by (transformers' one-token shift of `labels`); that tensor becomes an input
  the caller computes from the whole inputs and cuts (`ContextPlan.extra_inputs`), so a shift crosses the
  rank's chunk boundaries as on one process. The loss output and the outputs with a sequence dim are
  named in the plan (`passes.ops.context.LossSum`, `SeqGather`).
- **Refusals.** Slicing, padding, rolling, flipping or a cumulative op along a dim of the local length n
  (which would mix or shift this rank's tokens as if they were the whole sequence) raises, naming the op;
  the last dim of a tensor of 3 or more dims is taken as features, whatever its size. This reads sizes, not
  the data flow: an op along another dim that happens to be n long is refused too. A product whose result
  is [.., n, n] (attention written as matmul and softmax) is refused as well; token mixing by other ops (a
  pooling over the sequence) is not caught.

`finish` runs on the per-rank program: each `scaled_dot_product_attention` becomes a `ContextAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from passes.compat import pytree
from passes.errors import UsageError
from passes.layout import local_shape
from passes.meta import LAYOUT, PLAN_ARGS, ROLE
from passes.nodes import arg, module_path, source_line
from passes.cost.context import can_run
from passes.ops.context import ContextAttention, positions, take
from passes.ops.modules import GroupedHeadsAttention

__all__ = ["ContextPlan", "finish", "prepare"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# ops a loss or a target passes through with its elements in order
_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default,
            aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default, aten.to.dtype,
            aten.to.dtype_layout, aten.to.device, aten.squeeze.default, aten.flatten.using_ints}
_CLASS_LOSSES = {aten.cross_entropy_loss.default: 4, aten.nll_loss.default: 4, aten.nll_loss_nd.default: 4}
_PRODUCTS = (aten.bmm.default, aten.mm.default, aten.baddbmm.default, aten.matmul.default, aten.addmm.default)
_ALONG = {aten.slice.Tensor: 1, aten.narrow.default: 1, aten.roll.default: 2, aten.flip.default: 1,
          aten.cumsum.default: 1, aten.cumprod.default: 1, aten.diff.default: 2, aten.cummax.default: 1,
          aten.constant_pad_nd.default: None, aten.pad.default: None}


@dataclass
class ContextPlan:
    """What a call of a context-parallel program needs beyond the rank's part of its inputs."""

    cp: int
    n: int  # the local sequence length the program was captured at
    inputs: int  # the user inputs before the extra ones
    targets: list = field(default_factory=list)  # (GraphModule, [user input index]) per extra input
    loss: int | None = None  # the output leaf that is the model's mean loss
    ignore_index: int = -100
    seq_outputs: list = field(default_factory=list)  # output leaves with the sequence as dim 1

    def whole_targets(self, full: list) -> list:
        """The extra inputs over the whole sequence, from the whole inputs (`full`, flat, in placeholder order)."""
        return [gm(*(full[i] for i in idx)) for gm, idx in self.targets]

    def extra_inputs(self, wholes: list, rank: int) -> list:
        """Rank `rank`'s parts of `whole_targets`."""
        return [take(w, 1, rank, self.cp) for w in wholes]

    def share(self, wholes: list, rank: int) -> torch.Tensor:
        """This rank's share of the targets the loss counts (the first of `whole_targets`)."""
        counted = wholes[0] != self.ignore_index
        mine = take(counted, 1, rank, self.cp).sum()
        return mine.to(torch.float32) / counted.sum().to(torch.float32)


def _where(node: Node) -> str:
    return f"{node.name} ({node.target}) in {module_path(node) or '<top>'} at {source_line(node) or '?'}"


def prepare(gm: GraphModule, cp: int, rank: int, cols: int, buffers: dict, constants: dict,
            sources: list) -> ContextPlan:
    """Rewrite `gm` (captured at 1/cp of the sequence, for a grid of `cols` columns) in place as the module
    docstring says; `sources` (the capture's per-placeholder (role, key)) gains the extra inputs. Returns the
    plan."""
    holders = gm.graph.find_nodes(op="placeholder")
    inputs = [p for p in holders if p.meta.get(ROLE) == "input"]
    seq = next((p for p in inputs if isinstance(v := p.meta.get("val"), torch.Tensor) and v.dim() >= 2), None)
    if seq is None:
        raise UsageError("context_parallel: the model takes no input with a sequence dim ([batch, sequence, ...]); "
                         "pass context_parallel=1")
    n = seq.meta["val"].shape[1]
    plan = ContextPlan(cp, n, len(inputs))
    keys = dict(zip(holders, sources))
    for node in list(gm.graph.find_nodes(op="call_function", target=SDPA)):
        _causal_attention(gm, node, n, keys, buffers, constants)
        _grouped_kv(node, cols)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ARANGES and _counts_tokens(node, n):
            _global_positions(gm, node, rank, cp, n)
    gm.graph.eliminate_dead_code()
    _loss_and_targets(gm, plan, sources)
    _refuse_token_mixing(gm, n)
    gm.graph.lint()
    gm.recompile()
    return plan


def _causal_attention(gm: GraphModule, node: Node, n: int, keys: dict, buffers: dict, constants: dict) -> None:
    mask, drop = arg(node, 3, "attn_mask"), arg(node, 4, "dropout_p", 0.0)
    kw = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "is_causal", "dropout_p")}
    causal = bool(arg(node, 5, "is_causal", False))
    if mask is not None:
        value = _constant(gm, mask, keys, buffers, constants)
        if value is None or not _is_causal(value, n):
            why = "it depends on an input, a padding mask, or on values unknown here" if value is None else \
                "another mask"
            raise UsageError(
                f"context_parallel: the attention {_where(node)} takes a mask that is not the causal triangle "
                f"built from sizes ({why}); context parallelism computes causal or unmasked attention only. Pass "
                f"no attention_mask (pack or pad the batch without one), or parallelize with context_parallel=1")
        causal = True
    node.args = tuple(node.args[:3])
    node.kwargs = {**kw, "dropout_p": drop, "is_causal": causal}


def _repeated(node) -> tuple:
    """(x, g) where `node` is x [b, h, n, d] with each head repeated g times (transformers' repeat_kv:
    unsqueeze(2), expand, reshape); (node, 1) otherwise."""
    if isinstance(node, Node) and node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        ex = node.args[0]
        if isinstance(ex, Node) and ex.target is aten.expand.default:
            un = ex.args[0]
            if isinstance(un, Node) and un.target is aten.unsqueeze.default and un.args[1] == 2:
                x, out = un.args[0], node.meta.get("val")
                xv = x.meta.get("val") if isinstance(x, Node) else None
                if isinstance(xv, torch.Tensor) and xv.dim() == 4 and out is not None and out.dim() == 4 \
                        and out.shape[1] % xv.shape[1] == 0 and out.shape[2:] == xv.shape[2:]:
                    return x, out.shape[1] // xv.shape[1]
    return node, 1


def _grouped_kv(node: Node, cols: int) -> None:
    """Keys and values whose heads the model repeated for grouped-query attention are gathered over the cp
    ranks before the repeat (SDPA's enable_gqa repeats them): g times fewer bytes."""
    (k, gk), (v, gv) = _repeated(node.args[1]), _repeated(node.args[2])
    heads = k.meta["val"].shape[1] if gk > 1 else 0
    if gk > 1 and gk == gv and heads % cols == 0 and not node.kwargs.get("enable_gqa"):
        node.args = (node.args[0], k, v)
        node.kwargs = {**node.kwargs, "enable_gqa": True}


def _constant(gm: GraphModule, out: Node, keys: dict, buffers: dict, constants: dict) -> torch.Tensor | None:
    """`out`'s value where it depends on no user input or parameter, computed on the CPU; else None."""
    need, stack = set(), [out]
    while stack:
        x = stack.pop()
        if x not in need:
            need.add(x)
            stack.extend(x.all_input_nodes)
    env: dict = {}
    cpu = torch.device("cpu")
    for x in gm.graph.nodes:
        if x not in need:
            continue
        if x.op == "placeholder":
            role, key = keys[x]
            if role not in ("buffer", "constant"):
                return None
            found = (buffers if role == "buffer" else constants).get(key)
            if not isinstance(found, torch.Tensor) or found.is_meta:
                return None
            env[x] = found
        elif x.op == "call_function":
            def real(a):
                return env[a] if isinstance(a, Node) else (cpu if isinstance(a, torch.device) else a)
            args = torch.fx.node.map_aggregate(x.args, real)
            kwargs = torch.fx.node.map_aggregate(x.kwargs, real)
            env[x] = x.target(*args, **kwargs)
        else:
            return None
    return env[out]


def _is_causal(mask: torch.Tensor, n: int) -> bool:
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (n, n):
        return False
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == tri).all())
    return bool(((mask == 0) == tri).all() and (mask[..., ~tri] == float("-inf")).all())


def _counts_tokens(node: Node, n: int) -> bool:
    v = node.meta.get("val")
    start = arg(node, 0, "start") if node.target is not aten.arange.default else 0
    step = arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
    return isinstance(v, torch.Tensor) and v.shape == (n,) and start == 0 and step == 1


def _global_positions(gm: GraphModule, node: Node, rank: int, cp: int, n: int) -> None:
    c, kw = n // 2, dict(node.kwargs)
    mine, first = positions(rank, cp, n), positions(0, cp, n)  # rank 0's: what every rank's plan text shows
    with gm.graph.inserting_before(node):
        parts = []
        for at in (0, c):
            p = gm.graph.call_function(aten.arange.start, (int(mine[at]), int(mine[at]) + c), kw)
            p.meta.update({"val": node.meta["val"].narrow(0, 0, c), PLAN_ARGS: (int(first[at]), int(first[at]) + c)})
            parts.append(p)
        cat = gm.graph.call_function(aten.cat.default, (parts, 0))
    cat.meta = dict(node.meta)
    node.replace_all_uses_with(cat)
    gm.graph.erase_node(node)


def _back(node: Node) -> Node:
    while isinstance(node, Node) and node.op == "call_function" and node.target in _THROUGH:
        node = node.args[0]
    return node


def _loss_and_targets(gm: GraphModule, plan: ContextPlan, sources: list) -> None:
    out = gm.graph.output_node()
    leaves = pytree.tree_leaves(out.args[0])
    for i, leaf in enumerate(leaves):
        v = leaf.meta.get("val") if isinstance(leaf, Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() >= 2 and v.shape[1] == plan.n:
            plan.seq_outputs.append(i)
        elif v.dim() == 0 and v.is_floating_point():
            loss = _back(leaf)
            reduction = arg(loss, 3, "reduction", 1) if loss.op == "call_function" else None
            if loss.op != "call_function" or loss.target not in _CLASS_LOSSES or reduction != 1 \
                    or plan.loss is not None:
                raise UsageError(
                    f"context_parallel: the model's output {leaf.name} is a number other than one mean "
                    f"cross-entropy over the tokens ({_where(loss)}); context parallelism sums each rank's "
                    f"mean by its share of the targets only for that. Return the logits and compute the loss "
                    f"on them, or parallelize with context_parallel=1")
            plan.loss = i
            plan.ignore_index = arg(loss, _CLASS_LOSSES[loss.target], "ignore_index", -100)
            _target_input(gm, loss, plan, sources)
        elif v.dim() >= 1:
            raise UsageError(f"context_parallel: the output {leaf.name} {tuple(v.shape)} has no sequence dim "
                             f"(dim 1 of size {plan.n}); context parallelism returns per-token outputs and a mean "
                             f"loss only. Parallelize with context_parallel=1")


def _target_input(gm: GraphModule, loss: Node, plan: ContextPlan, sources: list) -> None:
    """Replace the [b, n] tensor a loss's target is computed from by a new input (see the module docstring)."""
    start = _back(loss.args[1])
    v = start.meta.get("val")
    if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == plan.n):
        raise UsageError(f"context_parallel: the target of the loss {_where(loss)} is not a [batch, sequence] tensor "
                         f"computed from the inputs ({start.name}); parallelize with context_parallel=1")
    need, stack = [], [start]
    while stack:
        x = stack.pop()
        if x in need:
            continue
        if x.op == "placeholder" and x.meta.get(ROLE) != "input":
            raise UsageError(f"context_parallel: the loss's target {start.name} depends on {x.name} (a "
                             f"{x.meta.get(ROLE)}), not only on the inputs; parallelize with context_parallel=1")
        need.append(x)
        stack.extend(x.all_input_nodes)
    small, env, idx = Graph(), dict[Node, Node](), list[int]()
    holders = [p for p in gm.graph.find_nodes(op="placeholder") if p.meta.get(ROLE) == "input"]
    for x in gm.graph.nodes:
        if x in need:
            if x.op == "placeholder":
                idx.append(holders.index(x))
            env[x] = small.node_copy(x, lambda a: env[a])
    small.output(env[start])
    plan.targets.append((GraphModule(torch.nn.Module(), small), idx))
    last = gm.graph.find_nodes(op="placeholder")[-1]
    with gm.graph.inserting_after(last):
        holder = gm.graph.placeholder(f"context_target_{len(plan.targets) - 1}")
    holder.meta = {"val": v, ROLE: "input"}
    sources.append(("input", plan.inputs + len(plan.targets) - 1))
    start.replace_all_uses_with(holder)
    gm.graph.eliminate_dead_code()


def _refuse_token_mixing(gm: GraphModule, n: int) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _PRODUCTS:
            ov = node.meta.get("val")
            if isinstance(ov, torch.Tensor) and ov.dim() >= 2 and ov.shape[-1] == ov.shape[-2] == n:
                raise UsageError(
                    f"context_parallel: {_where(node)} makes an [{n}, {n}] product of the local tokens with each "
                    f"other (attention written as a matmul and softmax, e.g. attn_implementation='eager'), which "
                    f"each rank would compute over its own tokens only; use F.scaled_dot_product_attention "
                    f"(transformers: attn_implementation='sdpa'), or parallelize with context_parallel=1 (if the "
                    f"model's width equals the local sequence length {n} by chance, pick another length)")
        if node.op != "call_function" or node.target not in _ALONG:
            continue
        x = node.args[0]
        xv, ov = x.meta.get("val") if isinstance(x, Node) else None, node.meta.get("val")
        if not isinstance(xv, torch.Tensor) or not isinstance(ov, torch.Tensor):
            continue
        pos = _ALONG[node.target]
        if pos is None:  # a pad: the dims whose size it changes
            dims = [d for d in range(xv.dim()) if d < ov.dim() and xv.shape[d] != ov.shape[d]]
        else:
            d = arg(node, pos, "dim", 0)
            dims = list(d) if isinstance(d, (list, tuple)) else [d]
        # the last dim of a 3-d or larger tensor holds features (rotate_half's halves of a head, a fused qkv's
        # parts), whatever its size; the sequence is dim 1 of [b, s] and [b, s, h], dim 2 of [b, heads, s, d]
        dims = [d % xv.dim() for d in dims if xv.dim() == 2 or d % xv.dim() != xv.dim() - 1]
        if any(xv.dim() > 1 and xv.shape[d] == n for d in dims) and not (
                node.target is aten.slice.Tensor and ov.shape == xv.shape):
            raise UsageError(
                f"context_parallel: {_where(node)} works along a dim of the local sequence length {n} (a shift, "
                f"slice or running sum over the tokens), which each rank would compute on its own part only; "
                f"compute it outside the model or parallelize with context_parallel=1")


def _local(x: Node, grid) -> tuple:
    """The block of `x` this rank holds (its global shape at the local sequence length, split by its layout)."""
    shape, lay = tuple(x.meta["val"].shape), x.meta.get(LAYOUT)
    return local_shape(shape, lay, grid.shape, x.name, at=(grid.r, grid.c)) if lay is not None else shape


def finish(gm: GraphModule, grid, want: str = "auto") -> None:
    """Each attention of the per-rank program `gm` as a `ContextAttention` over `grid`'s cp ranks, in flavour
    `want` (the context_attention option: `passes.cost.context.FLAVOURS` or 'auto')."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), GroupedHeadsAttention):
            raise UsageError(f"context_parallel: the attention {node.name} picks its KV heads per column (the grid's "
                             f"columns do not divide the KV heads); pick a grid whose columns divide them, or "
                             f"parallelize with context_parallel=1")
    for node in list(gm.graph.find_nodes(op="call_function", target=SDPA)):
        q, k = node.args[0], node.args[1]
        blocks = tuple(_local(x, grid) for x in (q, k)) + (q.meta["val"].element_size(),)
        dropout = arg(node, 4, "dropout_p", 0.0)
        why = can_run(want, blocks[0][1], blocks[1][1], grid.cp, dropout > 0)
        if why:
            raise UsageError(f"context_attention={want!r} for the attention {_where(node)}: {why}; pass "
                             f"context_attention='auto' (the all-to-all where the heads allow, else the ring)")
        module = ContextAttention(grid, bool(arg(node, 5, "is_causal", False)), node.kwargs.get("scale"),
                                  dropout, node.name, blocks, want)
        name = f"autopar_context_{node.name}"
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, tuple(node.args[:3]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
