"""no_grad / autocast regions inside forward, and in-place ops, from capture to a 2x2 grid.

Single-process tests check the capture passes on their own (regions inlined with eager semantics,
in-place ops rewritten only where nothing can observe it, higher-order ops refused clearly);
multi-rank tests check parity with the unmodified model on one process, element-wise on every rank
(tests/compare.py): outputs, every gradient, buffers and parameters after optimizer steps.
"""

import pytest
import torch
import torch.nn as nn

from passes import ShardingError, capture, propagate
from passes.compat import HigherOrderOperator, set_grad_enabled
from passes.meta import LAYOUT
from tests import checks_capture as C
from tests.compare import failures

aten = torch.ops.aten


def _calls(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run(cap, model, *args):
    """The captured graph called the way ParallelModule calls it: parameters, buffers, inputs."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    flat = [params[k] if role == "param" else buffers[k] if role == "buffer" else args[k]
            for role, k in cap.sources]
    return cap.gm(*flat)[0]


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            z = y * 2
            with torch.enable_grad():
                w = y * 3  # grad on again inside: y requires grad, so w does too
        with torch.autocast("cpu", enabled=False):
            v = y.float() + 1
        return z + w + v


def test_regions_are_inlined_with_eager_grad_semantics():
    """Catches a region left as a higher-order op (AttributeError 'overloadpacket' in propagate), a
    region inlined without switching the grad mode (z would carry gradient), a grad mode not put back
    after the region (the rest of forward would run under no_grad), and nested regions lost."""
    torch.manual_seed(0)
    model, x = Nested(), torch.randn(2, 4)
    cap = capture(model, (x,))
    hops = [t for t in _calls(cap.gm) if isinstance(t, HigherOrderOperator)]
    assert not hops, hops
    assert _calls(cap.gm).count(set_grad_enabled) == 4  # two regions, each switched on and back
    got = _run(cap, model, x)
    want = model(x)
    assert torch.equal(got, want)
    got.sum().backward()
    g = model.lin.weight.grad.clone()
    model.zero_grad()
    want.sum().backward()
    assert torch.equal(g, model.lin.weight.grad)  # z carries no gradient in either: factor 4, not 6
    assert torch.is_grad_enabled()


def test_functionalize_rewrites_only_unobservable_inplace_ops():
    """Catches an in-place op on a buffer rewritten out of place (the buffer would never update), an
    in-place op on a view rewritten while its base is read later (the base would miss the write), and
    a promoted dtype leaking out of an out-of-place rewrite (x += y.double() keeps x float32)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(2))

        def forward(self, x):
            y = x * 2
            y += x.double()  # promotes out of place: cast back
            base = x + 1
            base[:, 0].mul_(3)  # a view of base, and base is read below: stays in place
            self.count.add_(1)  # a buffer: stays in place
            return y * base

    model, x = M(), torch.randn(2, 3)
    cap = capture(model, (x,))
    calls = _calls(cap.gm)
    assert aten.add_.Tensor in calls and aten.mul_.Tensor in calls and aten.add.Tensor in calls
    assert aten.to.dtype in calls
    got = _run(cap, model, x)
    assert got.dtype == torch.float32
    assert torch.equal(got, M()(x))
    assert torch.equal(model.count, torch.full((2,), 1.0))


def test_inplace_on_partial_sum_is_rewritten():
    """The graph the multi-rank test runs: `s *= 0.5` on a sum over the column-split hidden dim (a
    partial sum, which propagate refused to update in place) is an out-of-place mul after capture, so
    the parity test below does exercise in-place ops on partial sums."""
    model = C.InplaceNet()
    cap = capture(model, C._inputs("inplace", 4, 0))
    propagate(cap.gm, (2, 2))
    total = next(n for n in cap.gm.graph.nodes if n.target == aten.sum.dim_IntList)
    assert "P(sum)" in str(total.meta[LAYOUT]), total.meta[LAYOUT]
    assert [u.target for u in total.users] == [aten.mul.Tensor]
    left = [t for t in _calls(cap.gm) if getattr(t, "overloadpacket", aten.add).__name__.endswith("_")]
    assert not left, left


def test_type_as_reads_only_the_dtype_of_its_other_operand():
    """DeBERTa-v2's `relative_pos.type_as(query)`: a 0-d tensor cast like a 2-d one made the pointwise
    rule index a dim the output does not have (IndexError: tuple index out of range)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h * torch.tensor(3).type_as(h)

    cap = capture(M(), (torch.randn(4, 8),))
    res = propagate(cap.gm, (2, 2))
    assert not res.gathering_fallbacks


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,))


def test_other_higher_order_ops_are_refused_by_name():
    """A torch.cond (or any higher-order op but grad-mode and autocast regions) is refused with the op,
    the module path and the user's line, not an AttributeError from deep inside propagation."""
    cap = capture(Branchy(), (torch.randn(2, 4),))
    with pytest.raises(ShardingError, match=r"higher-order op cond at node .* in module <top> runs a subgraph "
                                            r"autopar cannot split; source: .*test_capture_regions.py"):
        propagate(cap.gm, (2, 2))


@pytest.mark.parametrize("name", ["ema", "shrink", "inplace"])
def test_module_parity_2x2(pool4, name):
    """ema: a buffer updated under no_grad in forward (wrong if the update is lost, applied twice, or
    carries gradient); shrink: a parameter decayed in place under no_grad before use (autograd refused
    the to_local view once modified; the update must persist into the optimizer step); inplace: add_,
    mul_, masked_fill_ and a chain of them on partial sums and split activations (refused before)."""
    res = pool4.run(C.module_parity, name)
    bad = failures(res)
    assert not bad, bad


@pytest.mark.parametrize("family", ["megatron_bert", "ctrl", "deberta_v2", "phimoe"])
def test_hf_family_parity_2x2(pool4, family):
    """Megatron-BERT (`embeddings += position_embeddings` on a partial sum), CTRL (`inputs_embeds *=
    sqrt(d)`), DeBERTa-v2 (type_as with a dtype-only operand; relative attention), PhiMoE (no_grad
    regions in the sparsemixer router): logits, loss and every gradient on every rank."""
    res = pool4.run(C.hf_parity, family)
    bad = failures([r["errs"] for r in res])
    assert not bad, bad


def test_inplace_view_ops_become_views():
    """BigBird's `band_mask.unsqueeze_(1)`: an in-place shape change of an intermediate is the view
    `unsqueeze` read by every later use (left in place it was refused on a split layout, and read
    through its argument it would have had the old shape)."""

    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            y.unsqueeze_(1)
            y.t_() if y.dim() == 2 else y.transpose_(0, 1)
            return y + 1

    x = torch.randn(3, 4)
    cap = capture(M(), (x,))
    calls = _calls(cap.gm)
    assert aten.unsqueeze.default in calls and aten.transpose.int in calls, calls
    assert not [t for t in calls if t.overloadpacket.__name__.endswith("_")], calls
    assert torch.equal(_run(cap, M(), x), M()(x))


def test_module_to_inside_forward_that_changes_nothing():
    """Switch Transformers' router runs `self.classifier = self.classifier.to(self.dtype)` in forward:
    export swaps the fake parameters and failed with "_apply(): Couldn't swap Linear.weight"; a .to()
    that converts nothing must trace as a no-op, and one that does convert must still convert."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.lin = self.lin.to(torch.float32)
            return self.lin(x)

    model, x = M(), torch.randn(2, 4)
    cap = capture(model, (x,))
    assert torch.equal(_run(cap, model, x), model(x))
    assert nn.Module.to.__qualname__ == "Module.to"  # torch's own method again after capture
    assert nn.Linear(2, 2).to(torch.float64).weight.dtype == torch.float64


def test_inplace_fallback_on_a_split_view_is_refused():
    """An in-place op with no split rule on a view of a split activation whose base is read later stays
    in place (rewriting it would lose the write to the base); gathering it would update a copy, so it
    is refused by name. (BigBird's scatter_ into a whole tensor, by contrast, runs: see below.)"""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)  # [b/R, 8/C]
            h[:, :4].index_fill_(1, torch.tensor([0, 2]), 0.0)
            return h

    cap = capture(M(), (torch.randn(4, 8),))
    with pytest.raises(ShardingError, match=r"in-place op aten.index_fill_.int_Scalar at node .* in module <top> "
                                            r"mutates a tensor laid out S\(0\)R, which it cannot update in place"):
        propagate(cap.gm, (2, 2))


def test_inplace_fallback_into_a_whole_tensor_runs():
    """BigBird's `view[...].scatter_(...)` writes split values into a tensor every rank holds whole:
    the fallback gathers only the values and updates the real tensor, so it is not refused."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)  # [b/R, 8/C]
            out = torch.zeros(4, 2, 8)
            out[:, 0].scatter_(1, torch.arange(8).expand(4, 8), h)
            return out.sum(1) + h

    model, x = M(), torch.randn(4, 8)
    cap = capture(model, (x,))
    res = propagate(cap.gm, (2, 2))
    assert [f.node.target for f in res.gathering_fallbacks] == [aten.scatter_.src]
    assert torch.equal(_run(cap, model, x), model(x))
