"""Estimated step time and memory of a propagated graph on one rank: the pricing `strategy` searches with.

Each node is priced from its rule's Strategy and its inputs' layouts, as the insertion pass would
rewrite it: a Redistribute per (input, layout) pair needed (shared by the consumers that need it), a
GradSync where a replicated input feeds split work, a kernel's own collectives. The bytes are those
of `passes.cost` (the same step walk and SUMMA volumes, evaluated on numbers), so they equal what
`explain` and the collective layer count. An alpha-beta model per mesh axis turns them into time: a
collective costs alpha + bytes/beta, a matmul flops/F; SUMMA's broadcast lowering overlaps its next
broadcast with the current matmul, so it is charged calls*alpha + max(bytes/beta, flops/F), the
all-gather lowering calls*alpha + bytes/beta + flops/F. Memory: the parameter blocks held, and every
intermediate that needs a gradient (an upper bound on what autograd saves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from passes.cost import redistribute_steps, summa_axis_elems
from passes.insert_collectives import gradsync_axes
from passes.layout import Layout, local_shape
from passes.ops import kernels
from passes.propagate import rule_key

aten = torch.ops.aten
MATMULS = {aten.linear.default: (0, 1), aten.addmm.default: (1, 2), aten.mm.default: (0, 1),
           aten.matmul.default: (0, 1)}  # matmul-like op -> (activation arg, weight arg)


@dataclass
class CostModel:
    """alpha (s per collective) and beta (bytes received per s) per mesh axis, and the matmul rate
    (see `autopar.calibrate` for measured values and the published defaults)."""

    alpha: tuple
    beta: tuple
    flops: float
    source: str = "?"

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """From the JSON `autopar calibrate` writes (see autopar/calibrate.py)."""
        axes = d["axes"]
        beta = tuple(float("inf") if a["beta_bytes_per_s"] is None else float(a["beta_bytes_per_s"]) for a in axes)
        return cls(tuple(float(a["alpha_s"]) for a in axes), beta, float(d["flops_per_s"]), d.get("source", "?"))

    def collective(self, axis: int, nbytes: float, calls: int = 1) -> float:
        return calls * self.alpha[axis] + nbytes / self.beta[axis]


@dataclass
class Estimate:
    time_s: float = 0.0
    bytes_per_axis: list = field(default_factory=lambda: [0.0, 0.0])
    param_bytes: float = 0.0
    activation_bytes: float = 0.0
    memory_bytes: float = 0.0
    lowerings: dict = field(default_factory=dict)  # SUMMA node name -> lowering

    def add(self, other: "Estimate", k: float) -> None:
        self.time_s += k * other.time_s
        for a in range(2):
            self.bytes_per_axis[a] += k * other.bytes_per_axis[a]
        self.param_bytes += k * other.param_bytes
        self.activation_bytes += k * other.activation_bytes
        self.lowerings.update(other.lowerings)


def _local_elems(v, lay, mesh) -> int:
    return math.prod(local_shape(tuple(v.shape), lay, mesh))


def _redistribute(src: Layout, dst: Layout, v, mesh, grad: bool) -> list:
    """(axis, bytes, calls) of `kernels.Redistribute(src -> dst)` forward and backward."""
    moves, _ = redistribute_steps(src, dst, mesh, _local_elems(v, src, mesh), v.element_size(), grad)
    return [(a, b, 1) for a, _, b in moves if mesh[a] > 1]


def _summa(strat, node, mesh, grads, cm: CostModel) -> Estimate:
    """One SUMMA node (forward and the backward products that run), with the faster lowering."""
    R, C = mesh
    x, w = strat.extra["x"], strat.extra["w"]
    xv = x.meta["val"]
    M, K, N = math.prod(xv.shape[:-1]), xv.shape[-1], node.meta["val"].shape[-1]
    per_axis = [n * xv.element_size() / (R * C) for n in summa_axis_elems(M, K, N, R, C, strat.extra["transposed"])]
    products = 1 + int(x in grads) + int(w in grads)
    compute = 2 * (M / R) * K * (N / C) * products / cm.flops
    pieces = R + C - math.gcd(R, C)
    bw = sum(per_axis[a] / cm.beta[a] for a in range(2) if mesh[a] > 1) * products
    lat = {lo: sum(cm.alpha[a] * n for a in range(2) if mesh[a] > 1) * products
           for lo, n in (("broadcast", pieces), ("allgather", 1))}
    times = {"broadcast": lat["broadcast"] + max(bw, compute), "allgather": lat["allgather"] + bw + compute}
    lowering = min(times, key=times.get)
    return Estimate(time_s=times[lowering], bytes_per_axis=[b * products for b in per_axis],
                    lowerings={node.name: lowering})


def _flops(node, strat, layouts, mesh) -> float:
    """Forward + backward FLOPs of a local matmul-like node on one rank (0 for other ops)."""
    t = node.target
    if t in MATMULS or t in (aten.bmm.default, aten.baddbmm.default):
        xi = MATMULS.get(t, (1 if t == aten.baddbmm.default else 0, None))[0]
        x = node.args[xi]
        lay = strat.inputs.get(x, layouts.get(x))
        if not isinstance(lay, Layout) or not isinstance(node.meta.get("val"), torch.Tensor):
            return 0.0
        k = local_shape(tuple(x.meta["val"].shape), lay, mesh)[-1]
        return 6.0 * _local_elems(node.meta["val"], strat.output, mesh) * k
    if t == aten.scaled_dot_product_attention.default:
        b, h, s, d = local_shape(tuple(node.args[0].meta["val"].shape), strat.output, mesh)
        return 12.0 * b * h * s * node.args[1].meta["val"].shape[-2] * d
    return 0.0


def _kernel_terms(node, strat, mesh, grads) -> list:
    """(axis, bytes, calls) of a norm or cross-entropy kernel's statistics (as `passes.cost`)."""
    terms, out_lay = [], strat.output
    if strat.kernel == "norm" and mesh[1] > 1:
        t = math.prod(local_shape(tuple(node.meta["val"].shape), out_lay, mesh)[:-1])
        size = kernels.norm_stat_size(node.args[0].meta["val"].dtype)
        fwd_calls, bwd_calls = kernels.NORM_STATS[node.target == aten.layer_norm.default]
        calls = fwd_calls + (bwd_calls if node.args[0] in grads else ())
        terms += [(1, 2 * (mesh[1] - 1) * k * size * t // mesh[1], 1) for k in calls]
    elif strat.kernel == "cross_entropy":
        rows = local_shape(tuple(node.args[0].meta["val"].shape), strat.inputs[node.args[0]], mesh)[0]
        if strat.extra["vocab_split"] and mesh[1] > 1:
            terms += [(1, 2 * (mesh[1] - 1) * 4 * rows // mesh[1], 1), (1, 2 * (mesh[1] - 1) * 8 * rows // mesh[1], 1)]
        if mesh[0] > 1:
            terms.append((0, 2 * (mesh[0] - 1) * 8 // mesh[0], 1))
    return terms


@dataclass
class _NodeCost:
    shared: list  # (key, terms): collectives a later consumer may share (one Redistribute per (input, layout))
    terms: list  # (axis, bytes, calls) of the node's own kernel
    summa: Estimate | None  # a SUMMA node's time, bytes and lowering
    compute_s: float
    params: list  # (parameter node, bytes held)
    activation_bytes: float


def _node_cost(node, strat, layouts, mesh, grads, cm) -> _NodeCost:
    shared, params = [], []
    for inp, need in strat.inputs.items():
        have, v = layouts.get(inp), inp.meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(have, Layout):
            continue
        if have != need:
            shared.append(((inp, need), _redistribute(have, need, v, mesh, inp in grads)))
        sync = tuple(a for a in gradsync_axes(node, strat.output, inp, need) if mesh[a] > 1)
        if sync:
            n = _local_elems(v, need, mesh) * v.element_size()
            shared.append(((inp, need, sync), [(a, 2 * (mesh[a] - 1) * n // mesh[a], 1) for a in sync] if inp in grads else []))
        if inp.op == "placeholder" and inp.meta.get("autopar_role") == "param":
            params.append((inp, _local_elems(v, have, mesh) * v.element_size()))
    summa = _summa(strat, node, mesh, grads, cm) if strat.kernel == "summa" else None
    terms = _kernel_terms(node, strat, mesh, grads) if summa is None else []
    act, v = 0.0, node.meta.get("val")
    if node in grads and isinstance(v, torch.Tensor) and isinstance(strat.output, Layout):
        act = _local_elems(v, strat.output, mesh) * v.element_size()
    compute = _flops(node, strat, layouts, mesh) / cm.flops if summa is None else 0.0
    return _NodeCost(shared, terms, summa, compute, params, act)


def price(nodes, layouts: dict, mesh, grads: set, cm: CostModel, params_seen: set | None = None,
          cache: dict | None = None) -> Estimate:
    """Estimated time, bytes and memory of `nodes` (already propagated) on one rank; a parameter in
    `params_seen` is not counted again (a tied table used before and after the blocks). `cache` keeps
    each node's costs under the key of its rule's result (`propagate.rule_key`)."""
    est, seen = Estimate(), set()
    params_seen = set() if params_seen is None else params_seen
    for node in nodes:
        strat = node.meta.get("autopar_strategy")
        if node.op == "placeholder" or strat is None:
            continue
        if cache is None:
            nc = _node_cost(node, strat, layouts, mesh, grads, cm)
        else:
            key = rule_key(node, layouts)
            nc = cache.get(key)
            if nc is None:
                nc = cache[key] = _node_cost(node, strat, layouts, mesh, grads, cm)
        terms = list(nc.terms)
        for key, ts in nc.shared:
            if key not in seen:
                seen.add(key)
                terms += ts
        if nc.summa is not None:
            est.add(nc.summa, 1)
        for a, nbytes, calls in terms:
            est.time_s += cm.collective(a, nbytes, calls)
            est.bytes_per_axis[a] += nbytes
        est.time_s += nc.compute_s
        for p, nbytes in nc.params:
            if p not in params_seen:
                params_seen.add(p)
                est.param_bytes += nbytes
        est.activation_bytes += nc.activation_bytes
    return est
