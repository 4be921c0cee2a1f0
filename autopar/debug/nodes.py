"""Node by node: this rank's program against the unmodified model's graph, for `autopar.verify`.

The parallel side is recorded while the program runs (`Recorder`, the observer
`ParallelModule.observing` runs each eager call through): the value of every node that has a layout,
and the gradient that reaches it in backward. The reference side is the same model captured again
(`passes.capture.export.capture` gives the same node names for the same model and inputs) and run
whole on this process, with the same recording. A node's reference value cut to this rank's block
(`block_of`) is what the rank should hold; inserted collectives (Redistribute, GradSync) are
compared with the value of the node they move, so a wrong collective is named as itself.

The first forward divergence is the earliest node, in graph order, whose value is outside the
tolerance on some rank. Without one, the first backward divergence is the latest node whose output
gradient is outside it: gradients flow from the output back, so that is the first place backward
went wrong, and the culprit is among that node's users.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import torch

from passes.capture.export import capture, flatten_inputs
from passes.compat import pytree
from passes.kernels.spec import GradSyncSpec, RedistributeSpec
from passes.layout import Layout, parts, split_dim
from passes.meta import INSERTED, KERNEL, LAYOUT, PARAM
from passes.nodes import module_path, source_line
from passes.ops import comm
from passes.transforms.insert_collectives import RESHAPES

__all__ = ["Divergence", "Recorder", "block_of", "excess", "first_divergence", "parameter_path", "partial_gradients",
           "reference"]


def excess(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """max over elements of |got - want| / (atol + rtol |want|): at most 1 is within tolerance. A NaN or
    inf on one side only, or a shape that differs, is inf; the same inf on both sides matches."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    finite = torch.isfinite(got) & torch.isfinite(want)
    same = ~torch.isfinite(want) & ((got == want) | (got.isnan() & want.isnan()))
    if not bool((finite | same).all()):
        return math.inf
    if not bool(finite.any()):
        return 0.0
    g, w = got[finite], want[finite]
    tol = atol + rtol * w.abs()
    diff = (g - w).abs()
    zero = tol == 0
    if bool((diff[zero] > 0).any()):
        return math.inf
    return float((diff[~zero] / tol[~zero]).max()) if bool((~zero).any()) else 0.0


def magnitude(t: torch.Tensor) -> float:
    """The largest finite |value| of t (0 for none)."""
    t = t.detach().double().cpu()
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def block_of(full: torch.Tensor, lay, grid) -> torch.Tensor | None:
    """This rank's block of a whole tensor laid out `lay` on `grid` (its torch.chunk block of a dim the
    grid does not divide); None where the block is not a cut of the whole: a partial sum, or a 3D cube
    weight's layout."""
    if not isinstance(lay, Layout) or len(lay.placements) != 2 or lay.has_partial:
        return None
    t = full
    for axis, p in enumerate(lay.normalized(full.dim()).placements):
        if split_dim(p) is not None:
            t = comm.block(grid, axis, t, p.dim, parts(p))
    return t


class Recorder:
    """Runs a program node by node (`torch.fx.Interpreter`) and keeps each floating-point node's value and,
    in backward, the gradient that reaches it. `only`: the node names to keep (None: every node)."""

    def __init__(self, only=None, first_call: bool = False):
        self.values: dict = {}  # node name -> value (detached copy)
        self.grads: dict = {}  # node name -> gradient reaching that value
        self.gm = None
        self.only = only
        self.first_call = first_call  # a pipeline stage: keep its first call only (micro-batch 0)

    def keep(self, node, out) -> None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if self.only is not None and node.name not in self.only:
            return
        self.values[node.name] = out.detach().clone()
        if out.requires_grad:
            out.register_hook(lambda g, name=node.name: self.grads.__setitem__(name, g.detach().clone()))

    def __call__(self, gm, args):
        if self.first_call and self.gm is not None:
            return gm(*args)
        self.gm = gm
        recorder = self

        class Run(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                recorder.keep(n, out)
                return out

        return Run(gm).run(*args)


def reference(model, args: tuple, kwargs: dict, loss_fn) -> tuple:
    """(Recorder, loss) of the unmodified model captured again and run whole here, forward and backward,
    on copies of its parameters (the model's own gradients are left as they are)."""
    cap = capture(model, args, kwargs)
    flat = flatten_inputs(cap, args, kwargs)
    locals_ = []
    for role, key in cap.sources:
        if role == "param":
            p = model.get_parameter(key)
            locals_.append(p.detach().clone().requires_grad_(p.requires_grad))
        elif role == "buffer":
            locals_.append(cap.buffers[key])
        elif role == "constant":
            locals_.append(cap.constants[key])
        else:
            locals_.append(flat[key])
    rec = Recorder()
    leaves = pytree.tree_leaves(rec(cap.gm, tuple(locals_)))
    loss = loss_fn(pytree.tree_unflatten(leaves, cap.out_spec))
    if loss.requires_grad:
        loss.backward()
    return rec, loss.detach()


@dataclass
class Divergence:
    """The first node of this rank's program whose value (forward) or output gradient (backward) is
    outside the tolerance."""
    direction: str  # "forward" | "backward"
    node: str
    op: str
    module: str  # the model's module path ('' at the top level)
    source: str  # the user's source line
    layout: str
    rank: int
    excess: float  # max |got - want| / (atol + rtol |want|)
    error: float  # max |got - want| / max |want|
    position: int  # the node's index in graph order
    inputs: list = field(default_factory=list)  # (name, layout, produced by, matches?) per input node
    users: list = field(default_factory=list)  # backward: the nodes whose backward fed it

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        if self.op.startswith("parameter "):
            return (f"first backward divergence: the gradient of {self.op} (rank {self.rank}) differs while every "
                    f"node's output gradient matches: its gradient comes from " + "; ".join(self.users))
        head = (f"first {self.direction} divergence: node {self.node!r} ({self.op}){where}, layout {self.layout}, "
                f"rank {self.rank}: {'value' if self.direction == 'forward' else 'output gradient'} off by "
                f"{self.error:.3g} of its largest magnitude ({self.excess:.3g}x the tolerance)")
        lines = [head]
        if self.source:
            lines.append(f"  source: {self.source}")
        for name, lay, made, ok in self.inputs:
            lines.append(f"  input {name}: layout {lay}, from {made}, {'matches' if ok else 'DIFFERS'}")
        if self.users:
            lines.append(f"  its gradient comes from: {', '.join(self.users)}")
        return "\n".join(lines)


def _op(node) -> str:
    spec = node.meta.get(KERNEL)
    if isinstance(spec, RedistributeSpec):
        return f"redistribute {spec.src} -> {spec.dst}"
    if isinstance(spec, GradSyncSpec):
        return f"gradient all-reduce over axes {spec.axes}"
    if spec is not None:
        return f"{type(spec).__name__} kernel"
    return str(node.target) if node.op == "call_function" else f"{node.op} {node.target}"


def _moved(node):
    """The node a parallel node's value stands for: itself, or for an inserted collective the node it moves."""
    while node.meta.get(INSERTED) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _counterpart(node, ref_gm) -> str | None:
    """The reference node of the same name; for an item of a tuple, the item of the same index of the
    same-named node (a program with sharded replicas runs each block as one call whose items have the
    names the model's graph gave others)."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        src, index = node.args[0].name, node.args[1]
        return next((r.name for r in ref_gm.graph.find_nodes(op="call_function", target=operator.getitem)
                     if isinstance(r.args[0], torch.fx.Node) and r.args[0].name == src and r.args[1] == index), None)
    return node.name


def op_keys(gm) -> dict:
    """node name -> (module path, op name, its count among such ops in that module before it): names a
    node the same way in the whole model's graph and in a pipeline stage's graph, whose node names
    restart (its `layer_norm` is the model's `layer_norm_4`)."""
    seen: dict = {}
    out = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_module") or n.meta.get(INSERTED):
            continue
        base = (module_path(n), re.sub(r"_\d+$", "", n.name))
        out[n.name] = (*base, seen.get(base, 0))
        seen[base] = seen.get(base, 0) + 1
    return out


def partial_gradients(gm) -> set:
    """The nodes whose output gradient is not the whole gradient of the value it stands for, so not
    comparable with the model's: a GradSync's output (this rank's share, all-reduced in its backward), a
    gather with a gradient sync folded in (reduce-scattered), a reshape between either and its consumer
    (the sync hoisted before it), every inserted collective (only the part of its source's gradient that
    flows through it: the source's other consumers add theirs at the source), and placeholders
    (parameters are compared whole, after the replicas' average)."""
    out = set()
    for n in gm.graph.nodes:
        spec = n.meta.get(KERNEL)
        if n.op == "placeholder" or n.meta.get(INSERTED) or isinstance(spec, GradSyncSpec) or (
                isinstance(spec, RedistributeSpec) and spec.synced):
            out.add(n.name)
        elif n.op == "call_function" and n.target in RESHAPES and any(
                isinstance(a, torch.fx.Node) and a.name in out for a in n.args[:1]):
            out.add(n.name)
    return out


def _expected(full: torch.Tensor, lay, grid, got: torch.Tensor, micro: int) -> torch.Tensor | None:
    """This rank's block of a reference value; with `micro` > 1 micro-batches (a pipeline stage's first
    call), of micro-batch 0's rows where the value has the batch's rows first."""
    if micro > 1 and full.dim() == 0:
        return None  # a loss: micro-batch 0's is not the batch's
    if micro > 1 and full.shape[0] % micro == 0:
        part = block_of(full[: full.shape[0] // micro], lay, grid)
        if part is not None and part.shape == got.shape:
            return part
    return block_of(full, lay, grid)


def first_divergence(par: Recorder, ref: Recorder, grid, rtol: float, atol_frac: float, micro: int = 1) -> tuple:
    """(Divergence or None, nodes compared, nodes skipped) of this rank's recorded program against the
    reference: forward first; backward only where the forward matched everywhere here. `micro`: the
    micro-batches of a pipeline (its recorder holds micro-batch 0)."""
    nodes = [n for n in par.gm.graph.nodes if n.name in par.values] if par.gm is not None else []
    checked, skipped, bad = 0, 0, {}
    if micro > 1:  # a pipeline stage's graph: its nodes found in the whole model's by module path and op
        by_key = {k: name for name, k in op_keys(ref.gm).items()}
        mine = op_keys(par.gm)
        to_ref = {n.name: by_key.get(mine.get(_moved(n).name)) for n in nodes}
    else:
        to_ref = {n.name: _counterpart(_moved(n), ref.gm) for n in nodes}
    ref_nodes = {n.name: n for n in ref.gm.graph.nodes}

    def compare(values: dict, refs: dict, scale: float | None, leave=frozenset()):
        found = {}
        for i, n in enumerate(nodes):
            name = to_ref[n.name]
            if n.name not in values or name not in refs or n.name in leave:
                continue
            got = values[n.name]
            want = _expected(refs[name], n.meta.get(LAYOUT), grid, got, micro)
            if want is None:
                continue
            top = scale if scale is not None else magnitude(want)
            e = excess(got, want, rtol, atol_frac * top)
            if e > 1:
                err = (got.double() - want.double()).abs().max() if got.shape == want.shape else math.inf
                found[n] = (i, e, float(err) / max(magnitude(want), 1e-30))
        return found

    for n in nodes:
        name = to_ref[n.name]
        if name in ref.values and _expected(ref.values[name], n.meta.get(LAYOUT), grid, par.values[n.name],
                                            micro) is not None:
            checked += 1
        else:
            skipped += 1
    bad = compare(par.values, ref.values, None)
    if bad:
        n, (i, e, err) = min(bad.items(), key=lambda kv: kv[1][0])
        return _divergence("forward", n, i, e, err, grid, bad, ref_nodes.get(to_ref[n.name])), checked, skipped
    scale = max((magnitude(g) for g in ref.grads.values()), default=0.0)
    bad = compare(par.grads, ref.grads, scale, partial_gradients(par.gm))
    if bad:
        n, (i, e, err) = max(bad.items(), key=lambda kv: kv[1][0])
        return _divergence("backward", n, i, e, err, grid, bad, ref_nodes.get(to_ref[n.name])), checked, skipped
    return None, checked, skipped


def parameter_path(gm, name: str, grid) -> Divergence | None:
    """Where a parameter whose gradient differs (while no node's does) meets the program: its placeholder
    and the ops and collectives that use it, whose backward produced that gradient."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get(PARAM) == name:
            i = max((order[u] for u in n.users), default=order[n])  # where backward reaches it first
            users = []
            for u in n.users:
                chain = [u] + ([w for w in u.users] if u.meta.get(INSERTED) else [])
                users += [f"{w.name} ({_op(w)}{', ' + module_path(w) if module_path(w) else ''})" for w in chain]
            return Divergence("backward", n.name, f"parameter {name}", "", "", str(n.meta.get(LAYOUT, "?")),
                              grid.rank, math.inf, math.nan, i, [], users)
    return None


def _divergence(direction, n, i, e, err, grid, bad, ref_node) -> Divergence:
    """The Divergence at node n; its source line from the reference graph's node (a pipeline stage's graph
    is cut without stack traces)."""
    inputs = []
    for a in n.all_input_nodes:
        made = _op(a) if a.op != "placeholder" else "an input (placeholder)"
        inputs.append((a.name, str(a.meta.get(LAYOUT, "?")), made, a not in bad))
    users = [f"{u.name} ({_op(u)})" for u in n.users if u.op != "output"] if direction == "backward" else []
    source = source_line(ref_node) if ref_node is not None else source_line(n)
    return Divergence(direction, n.name, _op(n), module_path(n), source, str(n.meta.get(LAYOUT, "?")),
                      grid.rank, e, err, i, inputs, users)
