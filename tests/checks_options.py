"""Rank-side checks of what ParallelModule shows about itself (see test_options.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

import autopar


class Counted(nn.Module):
    """A Linear with one persistent and one non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("scratch", torch.zeros(8), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale + self.scratch


def accessors(rank):
    """What the accessors give before and after a call at another shape."""
    torch.manual_seed(0)
    model = Counted()
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(torch.randn(4, 8),))
    before = pm.graph_module
    out = {"graph before the first call": before is pm.program.gm and before.code == pm.graph_module.code,
           "first signature": pm.program.signature,
           "source model": pm.source_model is model,
           "persistent buffers": sorted(pm.persistent_buffer_names),
           "materialized": pm.materialized}
    pm(torch.randn(8, 8))
    out["signature after a call"] = pm.program.signature
    out["graph follows the call"] = pm.graph_module is pm.program.gm and pm.graph_module is not before
    return out
