"""Kernel specs on one process: the formulas `explain` prints and the numbers the estimate adds up are
the same steps, every inserted module carries its spec, and FLOPs count the products that run."""

import pytest
import torch

import autopar
from examples.models import GPTConfig, TinyGPT
from passes.cost.planned import node_cost, nodes_needing_grad
from passes.kernels.spec import KernelSpec, Site, SummaSpec
from passes.meta import KERNEL
from passes.ops.summa_group import SummaGroup


def _tiny_gpt():
    cfg = GPTConfig(vocab_size=64, hidden=32, heads=4, layers=1, max_seq=8)
    ids = torch.zeros(4, 8, dtype=torch.long)
    return TinyGPT(cfg), (ids, ids)


@pytest.mark.parametrize("grid", [(2, 2), (2, 4), (1, 2)])
def test_formulas_and_numbers_are_one_source(grid):
    """Catches a kernel whose symbolic bytes (explain, plan) and numeric bytes (the strategy estimate)
    drift apart, e.g. a statistic counted at another size in one of them. Both lowerings: under the
    all-gather one q|k|v run as one group, whose members carry the specs (the group node has none)."""
    model, args = _tiny_gpt()
    for lowering in ("broadcast", "allgather"):
        _one_source(autopar.plan(model, grid=grid, example_inputs=args, measure_activations=False,
                                 lowering=lowering), grid)


def _one_source(pl, grid):
    gm, grads = pl.gm, nodes_needing_grad(pl.gm)
    kinds = set()
    for node in gm.graph.find_nodes(op="call_module"):
        if isinstance(gm.get_submodule(node.target), SummaGroup):
            continue
        spec = node.meta[KERNEL]
        assert isinstance(spec, KernelSpec), node.name
        assert node.target.startswith(f"autopar_{spec.name}_"), (node.target, spec)
        kinds.add(spec.name)
        site = Site.inserted(node, grid, grads)
        steps = spec.steps(site, spec.values(site), exact=False)
        cost = node_cost(gm, node, grid, grads)
        assert sum(b for _, p, b in steps if p == "fwd") == cost.fwd, node.name
        assert sum(b for _, p, b in steps if p == "bwd") == cost.bwd, node.name
    assert {"summa", "norm", "embedding", "cross_entropy", "redist"} <= kinds


def test_flops_count_the_products_that_run():
    """Catches a FLOP count that charges the backward product of an input without gradient (the
    model's own input) or leaves out a matmul run locally (a replicated weight)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(8, 16)
    pl = autopar.plan(model, grid=(2, 2), example_inputs=(x,), measure_activations=False)
    summa = [r for r in pl.rows if r.op.startswith("SummaLinear")]
    per_product = [2 * 8 * 16 * 32 // 4, 2 * 8 * 32 * 8 // 4]  # 2 m k n / (R C)
    assert [r.flops for r in summa] == [2 * per_product[0], 3 * per_product[1]]  # no dX for the input
    specs = [n.meta[KERNEL] for n in pl.gm.graph.find_nodes(op="call_module")]
    assert sum(isinstance(s, SummaSpec) for s in specs) == 2

    rep = autopar.plan(model, grid=(2, 2), example_inputs=(x,), strategy="auto", measure_activations=False,
                       cost_model={"version": 1, "source": "test", "grid": [2, 2], "backend": "gloo", "device": "cpu",
                                   "axes": [{"alpha_s": 1.0, "beta_bytes_per_s": 1.0, "points": []}] * 2,
                                   "flops_per_s": 1e15, "when": "test"})
    local = [r for r in rep.rows if r.op == "linear"]
    assert local and all(r.flops > 0 for r in local), [(r.node, r.note, r.flops) for r in local]
