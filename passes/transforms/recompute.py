"""Activation recomputation: regions of the per-rank graph that autograd keeps only the inputs of, and
runs again in backward.

Two policies, both decided on the rewritten per-rank graph, so every rank groups the same nodes and
recomputes them in the same order (collectives inside a recomputed region then pair up):

    blocks     each repeated block (the nodes of `model.layers.3`, `transformer.h.3`, ...: the
               module path up to its first numbered part) is one region. Only the block's inputs
               are kept; its whole forward runs again in backward, SUMMA broadcasts included.
    selective  inside each block, the runs of local ops between the kept ones form the regions. Kept
               (saved as usual): every inserted module (SUMMA kernels, sharded norms, redistributions:
               anything that communicates) and the local matmuls and attention. So no byte is
               communicated twice; what is recomputed is pointwise, norm-statistics, view and
               softmax work, whose intermediates are most of a block's saved tensors.

A region runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`: the RNG state of its
forward is restored for the recomputation (dropout draws the same masks), and recomputation runs the
whole region (`early_stop=False`), never a rank-dependent prefix of it. While a region is recomputed,
the collectives it runs are counted in `grid.log` under the phase `"recompute"` instead of `"fwd"`.

A region that updates a tensor in place (a buffer's running statistics) is not recomputed: running
it twice would apply the update twice.

Requires `nn_module_stack` on the nodes (capture; inserted modules carry their consumer's) and, on
the inserted modules, `KERNEL`. Adds `RECOMPUTE` (the region's module name) to the meta of every node
it puts in a region, on the graph it was given, which stays flat for `explain` and `plan`; returns a
new GraphModule whose regions are `Recompute` modules returning a tuple, unpacked by getitem nodes
that carry the meta of the values they stand for.

>>> import torch
>>> from collections import OrderedDict
>>> from torch.nn import Linear, Sequential, Tanh
>>> from passes.capture.export import capture
>>> from passes.mesh import Grid
>>> net = Sequential(OrderedDict(h=Sequential(Sequential(Linear(4, 4), Tanh()), Sequential(Linear(4, 4), Tanh()))))
>>> gm = capture(net, (torch.randn(2, 4),)).gm
>>> out = recompute(gm, Grid.for_planning(1, 1), "blocks")
>>> [(name, m.name) for name, m in out.named_children() if isinstance(m, Recompute)]
[('autopar_recompute_0', 'h.0'), ('autopar_recompute_1', 'h.1')]
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.nn as nn
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import checkpoint

from passes.compat import fake_tensor_mode
from passes.cost.planned import nodes_needing_grad
from passes.kernels.spec import MATMULS, SDPA
from passes.layout import Layout, local_shape
from passes.mesh import Grid
from passes.meta import LAYOUT, RECOMPUTE, ROLE
from passes.options import RECOMPUTE_MODES
from passes.nodes import block_of
from passes.errors import UsageError

__all__ = ["MODES", "Recompute", "recompute", "regions", "boundary", "region_body", "group_runs", "block_runs"]

MODES = RECOMPUTE_MODES
aten = torch.ops.aten
# local ops selective recomputation keeps (their outputs are saved): the expensive ones
KEPT = frozenset(MATMULS) | {SDPA, aten.bmm.default, aten.baddbmm.default,
                             aten._scaled_dot_product_flash_attention.default,
                             aten._scaled_dot_product_efficient_attention.default}


class Recompute(nn.Module):
    """Run `body` keeping only its inputs for backward, which runs it again (with the RNG state its
    forward had). Without grad mode it just runs `body`."""

    def __init__(self, body: GraphModule, grid: Grid, name: str):
        super().__init__()
        self.body, self.grid, self.name = body, grid, name

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False, early_stop=False, context_fn=self._contexts)

    def _contexts(self):
        return contextlib.nullcontext(), self.grid.log.recomputing_region()

    def extra_repr(self) -> str:
        return self.name


def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _kept(node: Node) -> bool:
    """Selective recomputation leaves this node out of the regions: it communicates or is expensive."""
    return node.op == "call_module" or node.target in KEPT


def _local_fake(node: Node, mesh, grads: set, at: tuple) -> torch.Tensor:
    """A fake tensor with the shape of the block of `node`'s value that grid position `at` holds (its
    torch.chunk block of a dim the grid does not divide, as the localized graph expects)."""
    v, lay = node.meta["val"], node.meta.get(LAYOUT)
    shape = local_shape(tuple(v.shape), lay, mesh, at=at) if isinstance(lay, Layout) else tuple(v.shape)
    return torch.empty(shape, dtype=v.dtype, requires_grad=node in grads and v.dtype.is_floating_point)


def _pays(gm: GraphModule, run: list, mesh, grads: set, at: tuple) -> bool:
    """Selective: whether recomputing `run` keeps fewer bytes than running it plainly. Runs it once on
    fake blocks: plainly it saves its intermediates (and some inputs); recomputed it keeps all of
    its activation inputs (parameters are held anyway). A run of views saves nothing and would only
    add its input."""
    inputs, outputs = boundary(run)
    if not outputs or any(not isinstance(a.meta.get("val"), torch.Tensor) for a in inputs):
        return False
    body, saved = region_body(gm, run, inputs, outputs), {}

    def pack(t):
        saved[id(t)] = t.numel() * t.element_size()
        return t

    with fake_tensor_mode():
        args = [_local_fake(a, mesh, grads, at) for a in inputs]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            body(*args)
    ids = {id(t) for t in args}
    intermediates = sum(b for i, b in saved.items() if i not in ids)
    added = sum(t.numel() * t.element_size() for t, a in zip(args, inputs)
                if id(t) not in saved and a.meta.get(ROLE) != "param")
    return intermediates > added


def block_runs(gm: GraphModule) -> list:
    """Runs of consecutive call nodes of one block, in graph order."""
    runs: list[list[Node]] = []
    current: list[Node] = []
    key = None
    for node in gm.graph.nodes:
        block = block_of(node) if node.op in ("call_function", "call_module") else None
        if block != key or block is None:
            runs.append(current)
            current, key = [], block
        if block is not None:
            current.append(node)
    runs.append(current)
    return runs


def _selective_runs(gm: GraphModule) -> list:
    """Groups of a block's local ops, each connected through values the others make, none read by a
    node outside it before its last node (so the group can run as one call at its last node). A node
    joins the open groups of its producers (merging them); a group closes when a node outside it
    (a kept one, or one of another block) reads one of its values."""
    groups: dict[int, list[Node]] = {}
    owner: dict[Node, int] = {}
    closed: set[int] = set()
    for node in gm.graph.nodes:
        block = block_of(node) if node.op in ("call_function", "call_module") else None
        local = block is not None and not _kept(node)
        producers = {owner[a] for a in node.all_input_nodes if a in owner and owner[a] not in closed
                     and block_of(a) == block}
        if not local or (node.target is operator.getitem and not producers):
            closed.update(owner[a] for a in node.all_input_nodes if a in owner)
            continue
        closed.update(owner[a] for a in node.all_input_nodes if a in owner and owner[a] not in producers)
        gid = min(producers) if producers else len(groups)
        groups.setdefault(gid, [])
        for other in sorted(producers - {gid}):
            for n in groups.pop(other):
                owner[n] = gid
                groups[gid].append(n)
        groups[gid].append(node)
        owner[node] = gid
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted(g, key=order.__getitem__) for _, g in sorted(groups.items())]


def regions(gm: GraphModule, mode: str, mesh=(1, 1), only=None, at: tuple = (0, 0)) -> list:
    """The node lists `recompute` groups, in graph order of their last node: runs of consecutive call
    nodes of one block (mode 'blocks'); groups of a block's local ops between the kept ones (mode
    'selective', see `_selective_runs`), only those whose recomputation keeps fewer bytes on a rank of
    `mesh`. A getitem of a value made outside stays outside; groups of fewer than two nodes and
    groups that mutate in place are left out. `only`: the blocks to recompute (module paths; None: all);
    `at`: the grid position whose blocks the selective check runs on (the rank's own: its graph is
    localized to them)."""
    if mode not in MODES:
        raise UsageError(f"recompute={mode!r}: expected one of {MODES} or None")
    out = []
    for run in block_runs(gm) if mode == "blocks" else _selective_runs(gm):
        if only is not None and run and block_of(run[0]) not in only:
            continue
        inside = set(run)
        run = [n for n in run if not (n.target is operator.getitem and n.args[0] not in inside)]
        if len(run) >= 2 and not any(_mutates(n) for n in run):
            out.append(run)
    if mode == "selective":
        grads = nodes_needing_grad(gm)
        out = [run for run in out if _pays(gm, run, mesh, grads, at)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(out, key=lambda run: order[run[-1]])


def boundary(run: list) -> tuple:
    """(inputs, outputs) of a region: values made outside and read inside, values made inside and read
    outside, each in graph order."""
    inside = set(run)
    inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    return inputs, outputs


def region_body(gm: GraphModule, run: list, inputs: list, outputs: list) -> GraphModule:
    """A GraphModule running `run` on `inputs` (its placeholders, in order), returning `outputs` as a
    tuple."""
    graph = Graph()
    env: dict[Node, Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in run:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    return GraphModule(gm, graph)


def _attr(gm: GraphModule, target: str):
    *path, leaf = target.split(".")
    return getattr(gm.get_submodule(".".join(path)), leaf)


def recompute(gm: GraphModule, grid: Grid, mode: str, only=None) -> GraphModule:
    """The program of `gm` with each region of `mode` (in the blocks `only`, None: all) run by a
    `Recompute` module; `gm` itself keeps its nodes (marked with `RECOMPUTE`)."""
    found = regions(gm, mode, grid.shape, only, at=(grid.r, grid.c))

    def wrap(i: int, run: list) -> tuple:
        inputs, outputs = boundary(run)
        for n in run:
            n.meta[RECOMPUTE] = f"autopar_recompute_{i}"
        body = Recompute(region_body(gm, run, inputs, outputs), grid, block_of(run[0]) or "")
        return f"autopar_recompute_{i}", body, inputs, outputs

    return group_runs(gm, found, wrap)


def group_runs(gm: GraphModule, runs: list, wrap) -> GraphModule:
    """A new program of `gm` in which each run (a list of nodes, in graph order of their last node)
    is one call_module node at the run's last node: `wrap(i, run)` gives (name, module, the values
    the call takes, the values it returns as a tuple, unpacked by getitem nodes that carry the meta of
    the values they stand for). The other nodes are copied; `gm` is not changed."""
    graph = Graph()
    env: dict[Node, Node] = {}
    last = {run[-1]: (i, run) for i, run in enumerate(runs)}
    grouped = {n for run in runs for n in run}
    wrappers = {}
    for node in gm.graph.nodes:
        if node in last:
            i, run = last[node]
            name, module, inputs, outputs = wrap(i, run)
            wrappers[name] = module
            call = graph.call_module(name, tuple(env[a] for a in inputs))
            call.meta["nn_module_stack"] = run[0].meta.get("nn_module_stack", {})
            for j, out in enumerate(outputs):
                env[out] = graph.call_function(operator.getitem, (call, j))
                env[out].meta = dict(out.meta)
        elif node not in grouped:
            env[node] = graph.node_copy(node, lambda a: env[a])
    owned = {n.target: wrappers.get(n.target) or _attr(gm, n.target) for n in graph.nodes
             if n.op in ("call_module", "get_attr")}
    new = GraphModule(owned, graph)
    new.graph.lint()
    new.recompile()
    return new
