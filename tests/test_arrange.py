"""The arrangement search on one process (`autopar.planning.grids`): a device count is arranged as a
grid, the cube or replicas by the same estimate strategy='auto' uses, 3D units where they are
estimated faster, and clear errors where a device count cannot be arranged. The searched
arrangements run on real ranks in test_cube.py."""

import pytest
import torch
import transformers

import autopar
from autopar.errors import MemoryLimitError, UsageError
from autopar.planning.grids import candidates, cube_side


def _wide_llama(layers=4, batch=16, seq=1024):
    """A Llama-7B-wide model (hidden 4096, 32 heads, intermediate 11008) of `layers` blocks, on meta."""
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, use_cache=False)
    with autopar.meta_init():
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, dict(input_ids=ids, labels=ids)


def test_candidates_are_every_arrangement():
    """Every R x C of p, the cube where p = q^3, and d x R x C for each d dividing p and the batch."""
    assert [cube_side(p) for p in (1, 8, 27, 64, 100, 512, 1000)] == [None, 2, 3, 4, None, 8, 10]
    assert candidates(4, 6) == [("2d", (1, 4)), ("2d", (2, 2)), ("2d", (4, 1)), ("replicas", (2, 1, 2)),
                                ("replicas", (2, 2, 1))]
    assert candidates(8, 1, cube=False) == [("2d", (1, 8)), ("2d", (2, 4)), ("2d", (4, 2)), ("2d", (8, 1))]
    every = candidates(512, 64)
    assert len(every) == len(set(every)) == 10 + 1 + sum(len([r for r in range(1, 512 // d + 1) if 512 // d % r == 0])
                                                         for d in (2, 4, 8, 16, 32, 64))
    assert all(d * r * c == 512 for kind, (d, r, c) in (x for x in every if len(x[1]) == 3) if kind == "replicas")


def test_the_cube_is_picked_with_3d_units_where_it_is_estimated_fastest():
    """A Llama-7B-wide model of 4 blocks on 512 devices with the default (GPU cluster) cost model: the
    search arranges them as the 8x8x8 cube with every linear 3D (the embedding's own 2D rule on the
    cube's 8x64 grid), estimated faster than every fixed scheme on every arrangement (2D, 1D, all-3D)
    and than the search on every 2D grid; plan(grid=512) plans that arrangement (its 29 linears
    CubeLinear), and the estimate's bytes equal the plan's."""
    model, kw = _wide_llama()
    pl = autopar.plan(model, grid=512, example_kwargs=kw, strategy="auto", measure_activations=False)
    gc = pl.arrangement
    assert (gc.layout, gc.grid, pl.grid) == ("3d", (8, 8, 8), (8, 64)), gc.to_json()
    assert {(row["layout"], row["grid"]) for row in gc.table} == set(candidates(512, cube=True, replicas=False))
    best_fixed = min(t for row in gc.table for t in row["fixed_s"].values())
    assert gc.best["auto_s"] <= best_fixed, (gc.best["auto_s"], best_fixed)
    assert gc.best["auto_s"] < min(row["auto_s"] for row in gc.table if row["searched"] and row["layout"] == "2d")
    linears = {k: o for k, o in pl.choice.assignment.items() if k.startswith("matmul:")}
    assert set(linears.values()) == {"3d"}, pl.choice.assignment
    ops = [r.op.split("(")[0] for r in pl.rows]
    assert ops.count("CubeLinear") == 4 * 7 + 1 and "SummaLinear" not in ops, ops
    assert round(sum(pl.choice.estimate.bytes_per_axis)) == pl.comm_bytes_per_rank_per_step
    assert "cube 8x8x8" in repr(pl) and gc.kwargs == {"grid": 512, "strategy": "auto"}


def test_a_device_count_that_cannot_be_arranged_is_refused():
    """A device count with a fixed strategy, with pipeline stages or with a cluster, a count that is not
    positive, and a memory limit no arrangement fits: errors that name the value and what to pass
    instead."""
    model, kw = _wide_llama(layers=1, batch=2, seq=16)
    with pytest.raises(UsageError, match=r"needs strategy='auto' \(got '2d'\).*grid=\(R, C\) with R \* C = 8"):
        autopar.plan(model, grid=8, example_kwargs=kw, strategy="2d", measure_activations=False)
    with pytest.raises(UsageError, match="with pipeline stages.*choose_pipeline"):
        autopar.plan(model, grid=8, example_kwargs=kw, strategy="auto", pipeline=2)
    with pytest.raises(UsageError, match="with cluster='dgx-h100': a cluster prices each axis"):
        autopar.plan(model, grid=8, example_kwargs=kw, strategy="auto", cluster="dgx-h100")
    with pytest.raises(UsageError, match="a device count must be a positive int"):
        autopar.plan(model, grid=0, example_kwargs=kw, strategy="auto")
    with pytest.raises(UsageError, match="devices=0"):
        autopar.choose_grid(model, 0, (), kw)
    with pytest.raises(MemoryLimitError, match=r"no arrangement of 8 devices fits memory_limit=1.0 MiB per rank: "
                       r"the smallest fixed-scheme estimate is .* MiB, on (the|\d replicas of the) \dx\d"):
        autopar.choose_grid(model, 8, (), kw, memory_limit="1MiB")
