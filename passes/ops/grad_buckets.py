"""Data-parallel gradient all-reduces in buckets, launched during backward.

With grid=(d, R, C) and d > 1 every parameter block's gradient is averaged over the d replicas. One
all-reduce per block costs one latency per block; here the blocks are grouped, in the order backward
completes their gradients (the reverse of the program's first uses), into buckets of at most
`bucket_bytes` each (one dtype per bucket), and each bucket is one all-reduce of its flattened
gradients. Two autograd Functions share one `StepBuckets` per forward call:

- `BucketReduce` wraps the blocks of one bucket before the program runs (identity forward). autograd
  runs the ready node created last first, so its backward runs after the program's whole backward:
  it waits for the bucket's all-reduce (or runs it now) and returns the averaged gradients, which
  autograd accumulates into the parameters' .grad as it did for one all-reduce per block.
- `Arrive` (eager programs: `with_arrivals` puts one before each block's first use in the graph, so it
  runs as soon as the block's gradient is complete) adds the gradient into its bucket's flat buffer;
  the block that completes a bucket launches its all-reduce asynchronously, which then overlaps the
  rest of backward. It passes a zero gradient on (an expanded scalar: no memory).

A bucket not launched during backward (a compiled program has no `Arrive` nodes) reduces
synchronously in `BucketReduce`. Either way each bucket is one call per training step on every
replica, in the same order on all of them.

>>> plan_buckets([(4, 1000, torch.float32), (4, 1000, torch.float32), (4, 10, torch.bfloat16)], 8000)
[[0, 1], [2]]
>>> plan_buckets([(4, 1000, torch.float32), (4, 1000, torch.float32)], 0)  # 0: one bucket per block
[[0], [1]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from passes.cost.volumes import all_reduce_bytes
from passes.mesh import Grid
from passes.ops.comm import tensor_bytes, guarded



def plan_buckets(blocks: list, cap_bytes: float) -> list:
    """Consecutive runs of `blocks` ((element size, numel, dtype), in backward order) of one dtype and
    at most `cap_bytes` each (a block larger than the cap is a bucket of its own): [[block index]]."""
    out: list = []
    size, dtype = 0, None
    for i, (esize, numel, dt) in enumerate(blocks):
        nbytes = esize * numel
        if not out or dt != dtype or size + nbytes > cap_bytes:
            out.append([])
            size, dtype = 0, dt
        out[-1].append(i)
        size += nbytes
    return out


@dataclass(frozen=True)
class BucketPlan:
    """Which parameter blocks of one program are averaged over the replicas, and how they are bucketed.
    `keys[i]`: the parameter name of slot i (backward order); `shapes`, `dtypes`: its block's;
    `buckets`: slot indices per bucket; `uses[i]`: the program's placeholders that read slot i."""

    keys: tuple
    shapes: tuple
    dtypes: tuple
    buckets: tuple
    uses: tuple

    @classmethod
    def build(cls, gm: fx.GraphModule, sources: list, blocks: dict, cap_bytes: float) -> "BucketPlan":
        """`sources`: (role, key) per placeholder of `gm` (`Captured.sources`); `blocks`: name -> the local
        block of each parameter that needs a gradient. Blocks no node reads get no gradient and are
        left out (nothing would call their all-reduce)."""
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        first: dict = {}  # key -> (first use, [placeholder index])
        for i, ((role, key), ph) in enumerate(zip(sources, placeholders)):
            if role != "param" or key not in blocks or not ph.users:
                continue
            use = min(order[u] for u in ph.users)
            was = first.get(key, (use, []))
            first[key] = (min(was[0], use), was[1] + [i])
        keys = sorted(first, key=lambda k: -first[k][0])  # backward completes the last-used first
        shapes = tuple(tuple(blocks[k].shape) for k in keys)
        dtypes = tuple(blocks[k].dtype for k in keys)
        sizes = [(blocks[k].element_size(), blocks[k].numel(), blocks[k].dtype) for k in keys]
        buckets = tuple(tuple(b) for b in plan_buckets(sizes, cap_bytes))
        return cls(tuple(keys), shapes, dtypes, buckets, tuple(tuple(first[k][1]) for k in keys))

    def bucket_bytes(self, b: int) -> int:
        """Bytes of bucket b's flattened gradients."""
        return sum(math.prod(self.shapes[i]) * self.dtypes[i].itemsize for i in self.buckets[b])

    def received(self, dp: int) -> int:
        """Bytes a rank receives per step in the buckets' all-reduces over `dp` replicas (ring)."""
        return sum(all_reduce_bytes(self.bucket_bytes(b), dp) for b in range(len(self.buckets)))


class StepBuckets:
    """One training step's state of a `BucketPlan`: per bucket, the flat gradient buffer, the slots
    still to arrive and the all-reduce in flight."""

    def __init__(self, plan: BucketPlan, grid: Grid, device: torch.device):
        self.plan, self.grid, self.device = plan, grid, device
        self.where: dict = {}  # slot -> (bucket, offset)
        for b, slots in enumerate(plan.buckets):
            off = 0
            for s in slots:
                self.where[s] = (b, off)
                off += math.prod(plan.shapes[s])
        self.flat: list = [None] * len(plan.buckets)
        self.left = [sum(len(plan.uses[s]) for s in slots) for slots in plan.buckets]  # arrivals to come
        self.arrived: list[set] = [set() for _ in plan.buckets]
        self.work: list = [None] * len(plan.buckets)

    def _buffer(self, b: int) -> torch.Tensor:
        if self.flat[b] is None:
            numel = sum(math.prod(self.plan.shapes[s]) for s in self.plan.buckets[b])
            self.flat[b] = torch.zeros(numel, dtype=self.plan.dtypes[self.plan.buckets[b][0]], device=self.device)
        return self.flat[b]

    def _slice(self, s: int) -> torch.Tensor:
        b, off = self.where[s]
        return self._buffer(b).narrow(0, off, math.prod(self.plan.shapes[s]))

    def arrive(self, s: int, g: torch.Tensor) -> None:
        """Slot s's gradient from one of its placeholders; the bucket's last arrival launches it."""
        b, _ = self.where[s]
        self._slice(s).add_(g.reshape(-1))
        self.arrived[b].add(s)
        self.left[b] -= 1
        if self.left[b] == 0:
            self._launch(b, async_op=True)

    def _launch(self, b: int, async_op: bool) -> None:
        grid, tag, flat = self.grid, f"dp:bucket{b}", self._buffer(b)
        grid.log.add(tag, "bwd", all_reduce_bytes(tensor_bytes(flat), grid.dp))
        grid.log.launch(tag, "bwd")
        with guarded(grid, "all-reduce", "dp", tag):
            self.work[b] = dist.all_reduce(flat, group=grid.dp_group, async_op=async_op)

    def finish(self, b: int, grads: tuple) -> list:
        """Bucket b's averaged gradients, one per slot: the launched all-reduce waited for, or (slots
        whose gradients came straight to `BucketReduce`) the gradients summed in and reduced now."""
        if self.work[b] is None:
            for s, g in zip(self.plan.buckets[b], grads):
                if g is not None and s not in self.arrived[b]:
                    self._slice(s).add_(g.reshape(-1))
            self._launch(b, async_op=False)
        else:
            with guarded(self.grid, "all-reduce", "dp", f"dp:bucket{b}"):
                self.work[b].wait()
        self._buffer(b).div_(self.grid.dp)
        return [self._slice(s).view(self.plan.shapes[s]) for s in self.plan.buckets[b]]


class BucketReduce(torch.autograd.Function):
    """The blocks of bucket `b`: identity forward; backward returns their gradients averaged over the
    replicas (`StepBuckets.finish`)."""

    @staticmethod
    def forward(ctx, step, b, *blocks):
        ctx.set_materialize_grads(False)  # a block the step never reads: None, not a zero tensor
        ctx.step, ctx.b = step, b
        return tuple(x.view_as(x) for x in blocks)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.step.finish(ctx.b, grads))


class Arrive(torch.autograd.Function):
    """A block at its first use in the program: identity forward; backward hands its gradient to the
    step's buckets (`StepBuckets.arrive`) and passes zero on."""

    @staticmethod
    def forward(ctx, x, step, s):
        ctx.step, ctx.s = step, s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.step.arrive(ctx.s, g)
        return g.new_zeros(()).expand(g.shape), None, None


def arrive(x: torch.Tensor, step: StepBuckets, s: int) -> torch.Tensor:
    """What a graph made by `with_arrivals` calls before the first use of slot s's block."""
    return Arrive.apply(x, step, s)


def with_arrivals(gm: fx.GraphModule, plan: BucketPlan) -> fx.GraphModule:
    """A copy of `gm` taking one more input, the step's `StepBuckets`, with an `arrive` call placed
    just before the first use of every placeholder `plan` buckets (autograd then runs its backward
    as soon as that placeholder's gradient is complete, not after the whole backward). `gm` is not
    changed; the copy shares its submodules."""
    graph = fx.Graph()
    env: dict = {}
    graph.graph_copy(gm.graph, env)  # every node but the output, whose value it returns
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(fx.map_arg(out_node.args[0], lambda n: env[n]))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_after(placeholders[-1]):
        step = graph.placeholder("autopar_grad_buckets")
    for s, uses in enumerate(plan.uses):
        for i in uses:
            ph = placeholders[i]
            users = list(ph.users)
            first = min(users, key=order.__getitem__)
            with graph.inserting_before(first):
                arrived = graph.call_function(arrive, (ph, step, s))
            for u in users:
                u.replace_input_with(ph, arrived)
    graph.lint()
    root = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    root.update({n.target: _attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"})
    return fx.GraphModule(root, graph, class_name=type(gm).__name__)


def _attr(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
