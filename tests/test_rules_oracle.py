"""The sharding rules against a brute-force oracle, in one process (no torch.distributed).

For every node whose rule runs the aten op itself on each rank's blocks (no kernel, no fallback), the
oracle simulates the R x C grid (square q x q and rectangular): it cuts the node's full inputs into the
blocks each rank (r, c) holds under the layouts the rule *requires*, runs the op on those blocks with
its sizes localized (what `passes.transforms.localize` does), reassembles the full result from the rank results
under the output layout the rule *claims*, and compares that with the op on the full tensors. A rule
that keeps a split through an op that mixes values across it, claims a wrong output layout, or forgets
to gather an input fails here with the node, its layouts and the mismatch.

Layout semantics (see passes/layout.py): on rank (r, c), Shard(d) over mesh axis 0 holds block r of
dim d (torch.chunk(q) along d), over axis 1 block c; Partial over an axis means the true value is the
sum (avg: the mean) over that axis's q ranks; Replicate means every rank holds the whole.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import Strided, chunk_range
from passes.transforms.localize import LOCALIZED, local_args
from torch.fx import Node
from torch.fx.node import map_aggregate

from passes.capture.export import capture
from passes.layout import REPLICATED, Layout, mesh_shape
from passes.transforms.localize import localize
from passes.meta import CAPTURED_AS, LAYOUT, STRATEGY
from passes.transforms.propagate import propagate
from passes.rules.registry import lookup
from passes.search import strategy as strategies

aten = torch.ops.aten
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------------------------ the oracle


def _is_tensor_value(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and len(v) > 0 and all(isinstance(t, torch.Tensor) for t in v)


def cut(full, layout, mesh, r: int, c: int):
    """The block rank (r, c) holds of `full` under `layout` (a tuple of layouts for a tuple value)."""
    mesh = mesh_shape(mesh)
    if isinstance(full, (tuple, list)):
        assert isinstance(layout, tuple) and len(layout) == len(full), (layout, len(full))
        return type(full)(cut(t, lay, mesh, r, c) for t, lay in zip(full, layout))
    if not isinstance(full, torch.Tensor):
        return full
    assert isinstance(layout, Layout), f"tensor input with layout {layout!r}"
    t = full
    for axis, p in enumerate(layout.placements):
        idx, q = (r, c)[axis], mesh[axis]
        if isinstance(p, Strided):  # block idx of each of the k equal parts, side by side
            d = p.dim % t.dim()
            t = torch.cat([part.chunk(q, d)[idx] for part in t.chunk(p.split_factor, d)], d)
        elif isinstance(p, Shard):
            d = p.dim % t.dim()
            lo, hi = chunk_range(t.shape[d], q, idx)  # torch.chunk blocks, as DTensor's Shard cuts
            t = t.narrow(d, lo, hi - lo)
        elif isinstance(p, Partial):
            assert t.dtype.is_floating_point, f"partial {p} of a {t.dtype} tensor"
            if p.reduce_op == "sum":
                t = t / q  # the q pieces over this axis sum to the whole
            else:
                assert p.reduce_op == "avg", p
    return t.clone()


def _combine(parts, p, what):
    if isinstance(p, Strided):
        d = p.dim % parts[0].dim()
        subs = [part.chunk(p.split_factor, d) for part in parts]  # [rank][part]
        return torch.cat([torch.cat([s[j] for s in subs], d) for j in range(p.split_factor)], d)
    if isinstance(p, Shard):
        return torch.cat(parts, p.dim % parts[0].dim())
    if isinstance(p, Partial):
        stacked = torch.stack(parts)
        return stacked.sum(0) if p.reduce_op == "sum" else stacked.mean(0)
    for i, part in enumerate(parts[1:], 1):  # Replicate: every rank must hold the same whole
        if part.shape != parts[0].shape or not torch.equal(part, parts[0]):
            raise AssertionError(
                f"{what}: claimed replicated over a mesh axis, but rank {i} of that axis holds a different "
                f"value (shapes {tuple(part.shape)} vs {tuple(parts[0].shape)})"
            )
    return parts[0]


def assemble(grid, layout, mesh, what: str = ""):
    """The full value from grid[r][c] (the rank results) under `layout`."""
    R, C = mesh_shape(mesh)
    if isinstance(grid[0][0], (tuple, list)):
        assert isinstance(layout, tuple) and len(layout) == len(grid[0][0]), (layout, len(grid[0][0]))
        return tuple(
            assemble([[grid[r][c][k] for c in range(C)] for r in range(R)], layout[k], (R, C), f"{what}[{k}]")
            for k in range(len(layout))
        )
    assert isinstance(layout, Layout), f"{what}: tensor output with layout {layout!r}"
    rows = [_combine([grid[r][c] for c in range(C)], layout[1], f"{what} (axis 1, row {r})") for r in range(R)]
    return _combine(rows, layout[0], f"{what} (axis 0)")


def _placeholder_values(cap, module, args) -> list:
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    vals = []
    for role, key in cap.sources:
        if role == "param":
            vals.append(params[key].detach())
        elif role == "buffer":
            vals.append(buffers[key])
        elif role == "constant":
            vals.append(cap.constants[key])
        else:
            vals.append(args[key])
    return vals


def full_values(gm, inputs) -> dict:
    """Every node's value on the full tensors."""
    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*inputs)
    return dict(interp.env)


class _At:
    """What a kernel that runs on the blocks alone reads of its grid: the shape and a position."""

    def __init__(self, shape: tuple, r: int, c: int):
        self.shape, self.r, self.c = shape, r, c


def check_node(node, env, q: int) -> str | None:
    """Simulate one node on the q x q grid; return a failure description, or None."""
    strat = node.meta[STRATEGY]
    out_lay = strat.output
    need = {}
    for inp in node.all_input_nodes:
        if not _is_tensor_value(env.get(inp)):
            continue
        # an input the rule does not name stays as it is (insert_collectives leaves it alone)
        need[inp] = strat.inputs.get(inp, inp.meta[LAYOUT])
    head = (
        f"{node.name} = {node.target}  q={q}  inputs "
        + ", ".join(f"{i.name}{tuple(env[i].shape) if isinstance(env[i], torch.Tensor) else ''}:{repr(lay)}"
                    for i, lay in need.items())
        + f"  -> output {repr(out_lay)}"
    )
    grid = []
    try:
        for r in range(mesh_shape(q)[0]):
            row = []
            for c in range(mesh_shape(q)[1]):
                blocks = {i: cut(env[i], lay, q, r, c) for i, lay in need.items()}

                def sub(a, blocks=blocks):
                    return blocks[a] if isinstance(a, Node) and a in blocks else (env[a] if isinstance(a, Node) else a)

                # the sizes rank (r, c) bakes: its torch.chunk blocks of a dim the grid does not divide
                baked = local_args(node, q, (r, c)) if node.target in LOCALIZED else node.args
                args = map_aggregate(baked, sub)
                kwargs = map_aggregate(node.kwargs, sub)
                with torch.no_grad():
                    if strat.kernel is not None:  # a kernel that runs on the blocks alone, built for (r, c)
                        module, operands = strat.kernel.build(node, _At(mesh_shape(q), r, c), "broadcast")
                        row.append(module.eval()(*[sub(o) for o in operands]))
                    else:
                        row.append(node.target(*args, **kwargs))
            grid.append(row)
        got = assemble(grid, out_lay, q, node.name)
    except Exception as e:  # a rank could not even run the op on its blocks, or ranks disagree
        return f"{head}\n    {type(e).__name__}: {e}"
    want = env[node]
    wants = tuple(want) if isinstance(want, (tuple, list)) else (want,)
    gots = got if isinstance(got, tuple) else (got,)
    for k, (w, g) in enumerate(zip(wants, gots)):
        if w.shape != g.shape:
            return f"{head}\n    output {k}: expected shape {tuple(w.shape)}, reassembled {tuple(g.shape)}"
        try:
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            return f"{head}\n    output {k}: {str(e).splitlines()[0]} {' '.join(str(e).split())[:300]}"
    return None


def check_local_rules(module: nn.Module, args: tuple, q: int, expect=(), expect_split: bool = True,
                      assignment: dict | None = None) -> list:
    """Capture `module`, propagate on a q x q grid and check every locally run node against the
    oracle. Returns the checked nodes' names.

    `expect`: aten overloads (or packets) that must be among the checked nodes. `expect_split`: at
    least one checked node must have had a non-replicated input or output, so a test meant to see
    split layouts cannot pass with everything replicated. `assignment`: a plan the strategy search can
    choose (unit key -> '2d', '1d' or 'rep', `passes.search.strategy.find_units`), marked before
    propagation; None: every unit 2D.
    """
    torch.manual_seed(0)
    module = module.eval()
    cap = capture(module, args)
    gm = cap.gm
    env = full_values(gm, _placeholder_values(cap, module, args))
    if assignment is not None:
        strategies.apply(gm, strategies.find_units(gm), assignment, {})
    propagate(gm, mesh=q)
    localize(gm, q)  # view/reshape/expand/unflatten sizes become block sizes, as on the ranks
    checked, failures, split_seen = [], [], False
    for node in gm.graph.nodes:
        strat = node.meta.get(STRATEGY)
        if node.op != "call_function" or strat is None:
            continue
        if (strat.kernel is not None and not strat.kernel.local) or strat.fallback \
                or not _is_tensor_value(env.get(node)):
            continue
        err = check_node(node, env, q)
        checked.append(node)
        if err:
            failures.append(err)
        lays = list(strat.inputs.values()) + [strat.output]
        flat = [one for lay in lays for one in (lay if isinstance(lay, tuple) else (lay,))]
        split_seen |= any(isinstance(one, Layout) and not one.is_replicated for one in flat)
    assert not failures, f"{len(failures)} rule(s) disagree with the oracle:\n" + "\n".join(failures)
    assert checked, "no node was checked: the test would pass vacuously"
    if expect_split:
        assert split_seen, "every checked node was replicated: the rules never saw a split input"
    targets = {n.meta.get(CAPTURED_AS, n.target) for n in checked}  # a view localize made a reshape: a view
    packets = {getattr(t, "overloadpacket", t) for t in targets}
    for op in expect:
        assert op in targets or op in packets, f"{op} was not checked; checked: {sorted(map(str, targets))}"
    return [n.name for n in checked]


# ---------------------------------------------------------------------------------- test modules

B, S_, H, NH = 6, 6, 12, 6  # divisible by 2 and 3; head_dim 2
QS = [2, 3, (2, 3), (3, 1), (1, 2)]  # square and rectangular grids


class Elementwise(nn.Module):
    """Linear (output S(0)S(2)), then elementwise ops broadcasting against replicated operands."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.w = nn.Parameter(torch.randn(H))
        self.register_buffer("bias2d", torch.randn(S_, H))

    def forward(self, x, y, mask):
        h = self.lin(x)  # [b, s, h]
        a = h + y  # y [s, h]
        a = a * self.w  # w [h]
        a = a - self.bias2d
        a = F.gelu(a) / 3.0
        a = torch.where(mask, a, torch.zeros_like(a))  # mask [s, h]
        a = a.masked_fill(~mask, -1.5)
        a = a + h.sigmoid() * torch.tanh(h)
        a = torch.maximum(a, h.exp().clamp(max=2.0))
        return a.pow(2) - torch.rsub(h, 1.0)


def _inputs_elementwise():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S_, H, generator=g)
    y = torch.randn(S_, H, generator=g)
    mask = torch.rand(S_, H, generator=g) > 0.5
    return x, y, mask


@pytest.mark.parametrize("q", QS)
def test_elementwise_broadcast_split(q):
    """Elementwise ops on an S(0)S(2) activation with [s, h], [h] and boolean-mask operands.

    Catches: a broadcast operand cut along the wrong (right-aligned) dim, an operand left replicated
    while the output claims a split (or split while the op broadcasts it), where/masked_fill masks
    not split like the values."""
    check_local_rules(Elementwise(), _inputs_elementwise(), q,
                      expect=(aten.add, aten.mul, aten.sub, aten.where, aten.masked_fill, aten.gelu))


class ElementwisePlain(nn.Module):
    def forward(self, x, y, mask):
        a = x + y
        a = a * y[0]
        a = torch.where(mask, a, x)
        return a.masked_fill(mask, 0.25).relu()


@pytest.mark.parametrize("q", QS)
def test_elementwise_replicated_inputs(q):
    """Plain replicated (RR) user inputs: catches a rule that invents a split with nothing split
    upstream (its output would claim blocks the ranks do not hold)."""
    x, y, mask = _inputs_elementwise()
    check_local_rules(ElementwisePlain(), (x, y, mask), q, expect=(aten.add, aten.where, aten.masked_fill),
                      expect_split=False)


class Reductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)  # S(0)S(2)
        s = h.sum(-1, keepdim=True)  # S(0)P(sum)
        m = h.mean(-1, keepdim=True)  # S(0)P(avg)
        s2 = h.sum(-1)  # [b, s] S(0)P(sum)
        m1 = h.mean(1)  # [b, h] S(0)S(1)
        tot = h.mean()  # P(avg)P(avg)
        all_sum = h.sum()  # P(sum)P(sum)
        centered = h - m  # partial operand of a pointwise op
        scaled = s * 2.0  # partial input alone: reduce-scattered onto a dim
        return s, m, s2, m1, tot, all_sum, centered, scaled, m1 + s2.sum(1, keepdim=True)


@pytest.mark.parametrize("q", QS)
def test_reductions_partial(q):
    """sum/mean over the split last dim give partial results (sum, avg); over an unsplit dim the
    split moves with keepdim=False. Catches: Partial(sum) for a mean (q times too big), a wrong
    shifted shard dim after a dim is dropped, keepdim misread."""
    names = check_local_rules(Reductions(), (torch.randn(B, S_, H),), q, expect=(aten.sum, aten.mean))
    assert len(names) >= 8


class Softmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        b, s, h = x.shape
        t = self.lin(x).view(b, s, NH, h // NH).transpose(1, 2)  # [b, nh, s, hd] S(0)S(1)
        scores = t @ t.transpose(-1, -2)  # [b, nh, s, s]
        p = scores.softmax(-1)
        lp = torch.log_softmax(scores, dim=2)
        c = torch.cumsum(scores, -1)
        tri = torch.tril(scores)
        return p, lp, c, tri, p.triu(1)


@pytest.mark.parametrize("q", QS)
def test_softmax_scan_tril(q):
    """softmax/log_softmax/cumsum over a dim, tril/triu on [b, nh, s, s] with batch and heads split.
    Catches a rule keeping the softmax (or tril's row/col) dim split: each rank would normalize over
    its block only."""
    check_local_rules(Softmax(), (torch.randn(B, S_, H),), q,
                      expect=(aten.softmax, aten.log_softmax, aten.cumsum, aten.tril, aten.triu))


class SoftmaxSplitDim(nn.Module):
    """Softmax over a dim that arrives split (the hidden dim after a Linear)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)  # S(0)S(2)
        return h.softmax(-1), h.softmax(0)


@pytest.mark.parametrize("q", QS)
def test_softmax_over_split_dim(q):
    """Softmax along a split dim must ask for it whole. Catches a rule keeping that split."""
    check_local_rules(SoftmaxSplitDim(), (torch.randn(B, S_, H),), q, expect=(aten.softmax,))


class TopkSort(nn.Module):
    """A router's picks: topk and sort along the last dim and along a split dim."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)  # S(0)S(2)
        v, i = h.topk(2, dim=-1)
        w, j = h.topk(3, dim=0)
        s, k = h.sort(dim=1, descending=True)
        return v, i, w, j, s, k


@pytest.mark.parametrize("q", QS)
def test_topk_and_sort(q):
    """topk and sort along the last (split) dim, the batch dim and the sequence dim. Catches a rule
    that keeps the picked dim split (each rank would pick among its block only) or moves the other
    splits off their dims."""
    check_local_rules(TopkSort(), (torch.randn(B, S_, H),), q, expect=(aten.topk, aten.sort))


class HeadReshapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        b, s, h = x.shape
        t = self.lin(x)  # [b, s, h] S(0)S(2)
        t4 = t.view(b, s, NH, h // NH)  # heads split
        tt = t4.transpose(1, 2)  # [b, nh, s, hd]
        back = tt.transpose(1, 2).contiguous().view(b, s, h)
        p = t4.permute(0, 2, 3, 1)  # [b, nh, hd, s]
        p_back = p.permute(0, 3, 1, 2).reshape(b, s, -1)
        flat = t.reshape(b * s, h)  # batch split survives (outermost), hidden stays split
        unflat = flat.view(b, s, h)
        f2 = tt.flatten(2)  # [b, nh, s*hd]
        u2 = t.unflatten(-1, (NH, h // NH))
        hd_split = t.view(b, s, 2, h // 2)  # hidden into (2, h/2)
        return back, p_back, unflat, f2, u2, hd_split, t.reshape(b, s * h), tt.reshape(b, NH, s, -1)


@pytest.mark.parametrize("q", QS)
def test_view_reshape_transpose_chains(q):
    """Multi-head attention reshapes and their inverses, permute, flatten/unflatten, merges.

    Catches: a split kept on an inner dim of a merged/split group (values from other blocks would be
    needed), a wrong localized size, a transpose/permute that moves the split to the wrong dim."""
    check_local_rules(HeadReshapes(), (torch.randn(B, S_, H),), q,
                      expect=(aten.view, aten.transpose, aten.permute, aten.reshape))


class Expand(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        b, s, h = x.shape
        t = self.lin(x)  # [b, s, h] S(0)S(2)
        first = t[:, :1, :]  # [b, 1, h]
        e = first.expand(b, s, h)
        e2 = t.unsqueeze(1).expand(-1, 4, -1, -1)  # [b, 4, s, h]
        e3 = t.sum(1, keepdim=True).expand(b, s, h)
        return e + t, e2, e3


@pytest.mark.parametrize("q", QS)
def test_expand_unsqueeze(q):
    """expand of a size-1 dim (with -1 sizes), unsqueeze. Catches: an expand size not localized,
    a split claimed on the expanded (broadcast) dim, an unsqueeze shifting the split wrongly."""
    check_local_rules(Expand(), (torch.randn(B, S_, H),), q, expect=(aten.expand, aten.unsqueeze))


class Slices(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        t = self.lin(x)  # S(0)S(2)
        full = t[:, :, :]
        part_split = t[..., 1:5]  # a partial slice of the split hidden dim
        part_batch = t[1:]  # of the split batch dim
        part_seq = t[:, 2:, :]  # of an unsplit dim
        stepped = t[:, ::2]
        sel = t[:, 0]
        nar = t.narrow(2, 3, 6)
        return full * 2, part_split, part_batch, part_seq, stepped, sel, nar


@pytest.mark.parametrize("q", QS)
def test_slices(q):
    """Full slices (a no-op on any layout) and partial slices of split and unsplit dims, select,
    narrow. Catches a partial slice of a split dim run on blocks (each rank would slice its own
    block) and a full slice that drops a split."""
    check_local_rules(Slices(), (torch.randn(B, S_, H),), q, expect=(aten.slice, aten.select))


class Splits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, 3 * H)

    def forward(self, x):
        qkv = self.lin(x)  # [b, s, 3h] S(0)S(2)
        q_, k_, v_ = qkv.split(H, dim=-1)  # along the split dim: gathered first
        a, b_ = qkv.chunk(2, dim=1)  # along an unsplit dim: the splits stay
        c, d = torch.split(qkv, [2, S_ - 2], dim=1)
        parts = qkv.unbind(1)
        (whole,) = qkv.split(S_, dim=1)  # a single piece
        return q_ + 1, k_ * v_, a - b_, c.sum(1), d, parts[0] * 3, whole * 2


@pytest.mark.parametrize("q", QS)
def test_split_chunk_unbind(q):
    """split/chunk/unbind along split and unsplit dims, and the getitem that takes each piece.

    Catches: the pieces' layouts being lost at getitem (a piece of a batch-split tensor claimed
    replicated), a split along a split dim run on blocks."""
    check_local_rules(Splits(), (torch.randn(B, S_, H),), q, expect=(aten.split, operator.getitem))


class LastDimUnbind(nn.Module):
    """x-transformers' rotary helper: pairs of the hidden dim viewed as a last dim of 2 and unbound."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x).view(*x.shape[:-1], H // 2, 2)  # [b, s, h/2, 2]
        a, b_ = h.unbind(-1)  # [b, s, h/2] each
        return a * 2 - b_, b_


@pytest.mark.parametrize("q", QS)
def test_unbind_of_the_last_dim(q):
    """unbind(-1), whose pieces have one dim fewer than the input. Catches the rule indexing the
    pieces' shapes with the input's dim (IndexError before: x-transformers' rotary crashed
    parallelize) and a split of an earlier dim not kept in the pieces."""
    check_local_rules(LastDimUnbind(), (torch.randn(B, S_, H),), q, expect=(aten.unbind,))


@pytest.mark.parametrize("q", [2, (1, 2), (2, 1)])
def test_complex_pairs_and_repeated_heads(q):
    """view_as_complex / view_as_real (torchtitan's rotary) and repeat_interleave over the head dim
    (litgpt's grouped KV heads): each rank's block against the oracle, with their inputs split (they
    fell back to whole tensors before). The backward: tests/test_foreign_models.py, on 4 ranks."""
    from tests.checks_foreign import ComplexRotaryGQA

    check_local_rules(ComplexRotaryGQA(), (torch.randn(4, 8, 32),), q,
                      expect=(aten.view_as_complex, aten.view_as_real, aten.repeat_interleave))


class Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H)

    def forward(self, x, y):
        ta, tb = self.a(x), self.b(x)  # S(0)S(2)
        along_split = torch.cat([ta, tb], dim=-1)
        along_unsplit = torch.cat([ta, tb], dim=1)
        along_batch = torch.cat([ta, tb], dim=0)
        with_rep = torch.cat([ta, y], dim=1)  # y replicated [b, s, h]
        return along_split, along_unsplit, along_batch, with_rep


@pytest.mark.parametrize("q", QS)
def test_cat(q):
    """cat along split and unsplit dims, and of a split with a replicated operand. Catches a cat
    along a split dim run on blocks (interleaves blocks) and operands split differently."""
    check_local_rules(Cat(), (torch.randn(B, S_, H), torch.randn(B, S_, H)), q, expect=(aten.cat,))


class Squeeze(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        t = self.lin(x)  # [b, s, h]
        u = t.unsqueeze(2)  # [b, s, 1, h]
        u0 = t.unsqueeze(0)
        return u.squeeze(2), u0.squeeze(0), u.squeeze(), t.unsqueeze(-1), u * 2


@pytest.mark.parametrize("q", QS)
def test_unsqueeze_squeeze(q):
    """unsqueeze/squeeze shift the split dims. Catches an off-by-one shard dim after a dim is added
    or removed."""
    check_local_rules(Squeeze(), (torch.randn(B, S_, H),), q, expect=(aten.unsqueeze, aten.squeeze))


class Attention(nn.Module):
    def __init__(self, mask_kind: str):
        super().__init__()
        self.q = nn.Linear(H, H)
        self.k = nn.Linear(H, H)
        self.v = nn.Linear(H, H)
        self.mask_kind = mask_kind

    def forward(self, x, mask=None):
        b, s, h = x.shape

        def heads(t):
            return t.view(b, s, NH, h // NH).transpose(1, 2)

        q_, k_, v_ = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.mask_kind == "causal":
            o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)
        return o.transpose(1, 2).reshape(b, s, h)


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("mask_kind", ["causal", "bool_ss", "float_b1ss", "bool_bhss"])
def test_sdpa(q, mask_kind):
    """scaled_dot_product_attention with batch and heads split, causal or with an explicit mask
    broadcasting against [b, nh, s, s]. Catches a split kept on the sequence or head_dim, and a mask
    cut along the wrong dim (or not cut while the scores are)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, S_, H, generator=g)
    if mask_kind == "causal":
        args = (x,)
    elif mask_kind == "bool_ss":
        m = torch.rand(S_, S_, generator=g) > 0.3
        m.fill_diagonal_(True)  # no fully masked rows (NaN)
        args = (x, m)
    elif mask_kind == "float_b1ss":
        args = (x, torch.randn(B, 1, S_, S_, generator=g))
    else:
        m = torch.rand(B, NH, S_, S_, generator=g) > 0.3
        m[..., torch.arange(S_), torch.arange(S_)] = True
        args = (x, m)
    check_local_rules(Attention(mask_kind), args, q, expect=(aten.scaled_dot_product_attention,))


class SdpaPlain(nn.Module):
    def forward(self, q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True) * 2


@pytest.mark.parametrize("q", QS)
def test_sdpa_replicated_inputs(q):
    """sdpa on replicated user inputs: the rule splits batch and heads itself (asking for split
    inputs); catches an output layout that disagrees with the blocks it asked for."""
    t = [torch.randn(B, NH, S_, 2) for _ in range(3)]
    check_local_rules(SdpaPlain(), tuple(t), q, expect=(aten.scaled_dot_product_attention,))


class ActMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, 2 * H)

    def forward(self, x):
        b, s, h = x.shape
        t = self.lin(x)
        q_, k_ = t.split(H, dim=-1)
        q_ = q_.view(b, s, NH, h // NH).transpose(1, 2)  # [b, nh, s, hd]
        k_ = k_.view(b, s, NH, h // NH).transpose(1, 2)
        att = q_ @ k_.transpose(-2, -1)  # [b, nh, s, s]
        out = att.softmax(-1) @ q_  # [b, nh, s, hd]
        bm = torch.bmm(att.flatten(0, 1), q_.flatten(0, 1))
        return att, out, bm


@pytest.mark.parametrize("q", QS)
def test_matmul_two_activations(q):
    """[b, nh, s, hd] @ [b, nh, hd, s] between activations runs locally on batch/head blocks.
    Catches a split kept on a contracted or matrix dim, or the two operands split differently."""
    check_local_rules(ActMatmul(), (torch.randn(B, S_, H),), q, expect=(aten.matmul, aten.bmm))


class ActMatmulPlain(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b).softmax(-1)


@pytest.mark.parametrize("q", QS)
def test_matmul_two_activations_replicated(q):
    """The same matmul on replicated inputs (nothing split to follow)."""
    a, b = torch.randn(B, NH, S_, 2), torch.randn(B, NH, 2, S_)
    check_local_rules(ActMatmulPlain(), (a, b), q, expect=(aten.matmul,), expect_split=False)


class ParamView(nn.Module):
    """A parameter used through a view: x + pos.unsqueeze(0), x * scale.view(1, 1, -1)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.pos = nn.Parameter(torch.randn(S_, H))
        self.scale = nn.Parameter(torch.randn(H))

    def forward(self, x):
        t = self.lin(x)  # S(0)S(2)
        return (t + self.pos.unsqueeze(0)) * self.scale.view(1, 1, -1)


@pytest.mark.parametrize("q", QS)
def test_parameter_through_view(q):
    """A parameter reaching a split elementwise op through unsqueeze/view (learned positions, a
    per-channel scale). Catches the consumer's request being passed back to the parameter as if the
    view were a transpose (the parameter then gets split along the wrong dim)."""
    check_local_rules(ParamView(), (torch.randn(B, S_, H),), q, expect=(aten.unsqueeze, aten.view))


class ScalarReshape(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        loss = self.lin(x).pow(2).mean()  # 0-d, partial
        return loss.reshape(1) * 3, loss.unsqueeze(0), loss.reshape(1).squeeze(0)


@pytest.mark.parametrize("q", QS)
def test_scalar_reshape(q):
    """A 0-d result viewed as [1] and back (`loss.reshape(1)`, `loss.unsqueeze(0)`). Catches the
    reshape rule crashing on 0-d shapes, and a partial scalar kept partial through the view."""
    check_local_rules(ScalarReshape(), (torch.randn(B, S_, H),), q, expect=(aten.unsqueeze,))


class GPTBlockish(nn.Module):
    """A causal self-attention written out by hand with a registered mask buffer, as GPT-2 does."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H)
        self.register_buffer("tri", torch.tril(torch.ones(S_, S_)).view(1, 1, S_, S_))

    def forward(self, x):
        b, s, h = x.shape
        q_, k_, v_ = self.qkv(x).split(H, dim=2)
        q_ = q_.view(b, s, NH, h // NH).transpose(1, 2)
        k_ = k_.view(b, s, NH, h // NH).transpose(1, 2)
        v_ = v_.view(b, s, NH, h // NH).transpose(1, 2)
        att = (q_ @ k_.transpose(-2, -1)) * (1.0 / (h // NH) ** 0.5)
        att = att.masked_fill(self.tri[:, :, :s, :s] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v_).transpose(1, 2).contiguous().view(b, s, h)
        return self.proj(y)


@pytest.mark.parametrize("q", QS)
def test_handwritten_causal_attention(q):
    """The whole hand-written attention chain (split, heads view, matmul, masked_fill with a sliced
    buffer, softmax, merge heads). Catches any rule of the chain disagreeing with its neighbours."""
    check_local_rules(GPTBlockish(), (torch.randn(B, S_, H),), q,
                      expect=(aten.matmul, aten.masked_fill, aten.softmax, aten.view))


class PreNormBlock(nn.Module):
    """A pre-norm transformer block as torchtitan writes it (nn.RMSNorm, SDPA, SwiGLU), summing the
    residual straight from the block's input."""

    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(H), nn.RMSNorm(H)
        self.wqkv = nn.Linear(H, 3 * H, bias=False)
        self.wo = nn.Linear(H, H, bias=False)
        self.w13 = nn.Linear(H, 4 * H, bias=False)
        self.w2 = nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q_, k_, v_ = (t.view(b, s, NH, h // NH).transpose(1, 2) for t in self.wqkv(self.attention_norm(x)).split(H, 2))
        y = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        h_ = x + self.wo(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.w13(self.ffn_norm(h_)).chunk(2, dim=-1)
        return h_ + self.w2(F.silu(gate) * up)


@pytest.mark.parametrize("q", [(2, 2), (1, 2), (2, 1)])
def test_every_plan_the_search_can_choose(q):
    """Every assignment of '2d', '1d' and 'rep' to the block's matmul units (the plans strategy='auto'
    chooses among; nanoGPT's attention under one of them crashed on its first call), each against the
    oracle: the rules of the ops between the products (norms on sequence blocks, views, attention,
    residual sums of partial sums) must agree whatever their neighbours were split as."""
    import itertools

    module, x = PreNormBlock(), torch.randn(B, S_, H)
    units = strategies.find_units(capture(module.eval(), (x,)).gm)
    keys = [u.key for u in units]
    assert len(keys) == 4, keys
    for options in itertools.product(*(u.options for u in units)):
        check_local_rules(module, (x,), q, assignment=dict(zip(keys, options)))


# -------------------------------------------------------------------------------- the oracle itself


def test_oracle_catches_a_wrong_rule():
    """The oracle is not vacuous: a softmax that keeps its reduced dim split is reported."""
    from passes.rules.registry import Strategy

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x):
            return self.lin(x).softmax(-1)

    module = M().eval()
    args = (torch.randn(B, S_, H),)
    cap = capture(module, args)
    env = full_values(cap.gm, _placeholder_values(cap, module, args))
    propagate(cap.gm, mesh=2)
    node = next(n for n in cap.gm.graph.nodes if n.target == aten.softmax.int)
    src = node.args[0]
    bad = Layout((Shard(0), Shard(2)))
    node.meta[STRATEGY] = Strategy({src: bad}, bad)
    assert "softmax" in (check_node(node, env, 2) or "")
    good = Layout((Shard(0), Replicate()))
    node.meta[STRATEGY] = Strategy({src: good}, good)
    assert check_node(node, env, 2) is None


def test_oracle_cut_assemble_roundtrip():
    """cut and assemble are inverses for every layout kind (so a failure above is the rule's)."""
    t = torch.randn(6, 6, 6)
    for lay in [Layout((Shard(0), Shard(2))), Layout((Shard(2), Shard(0))), Layout((Replicate(), Shard(1))),
                Layout((Partial("sum"), Shard(1))), Layout((Shard(1), Partial("avg"))),
                Layout((Partial("sum"), Partial("avg"))), REPLICATED]:
        for q in (2, 3):
            grid = [[cut(t, lay, q, r, c) for c in range(q)] for r in range(q)]
            torch.testing.assert_close(assemble(grid, lay, q), t, rtol=RTOL, atol=ATOL)
    with pytest.raises(AssertionError, match="replicated"):
        assemble([[torch.zeros(2), torch.ones(2)], [torch.zeros(2), torch.ones(2)]], REPLICATED, 2)


# ------------------------------------------------------------------------------------- fallback


class Inner(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, dim=1) + 1


class WithFallback(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.inner = Inner()

    def forward(self, x):
        return self.inner(self.lin(x))


def test_no_rule_falls_back_to_replication():
    """An op with no sharding rule (cumprod) gathers every input whole and is listed, with its
    module path, in Propagation.fallbacks. Catches a node without a rule being run on blocks
    (silently wrong) or falling back without being reported."""
    assert lookup(aten.cumprod.default) is None
    module = WithFallback().eval()
    args = (torch.randn(B, S_, H),)
    cap = capture(module, args)
    res = propagate(cap.gm, mesh=2)
    node = next(n for n in cap.gm.graph.nodes if n.target == aten.cumprod.default)
    strat = node.meta[STRATEGY]
    assert strat.fallback and strat.kernel is None
    assert strat.inputs and all(lay == REPLICATED for lay in strat.inputs.values())
    assert strat.output == REPLICATED
    assert node.args[0].meta[LAYOUT] == Layout((Shard(0), Shard(2)))  # so a gather is needed
    entries = [f for f in res.fallbacks if f.node is node]
    assert entries, res.fallbacks
    path, why = entries[0].path, entries[0].reason
    assert path == "inner"
    assert "cumprod" in why
    # the ops after it still check out (the add sees a replicated input)
    check_local_rules(WithFallback(), args, 2, expect=(aten.add,), expect_split=False)
