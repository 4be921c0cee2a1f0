"""Blocks as calls: each repeated block of a per-rank program (`model.layers.3`, `transformer.h.3`:
`passes.nodes.block_of`) run by one call that fetches the block's own parameters itself.

Sharded replicas (`autopar.parallel.sharded`) make each such block an FSDP2 unit: its parameters are
gathered over the replicas just before the block runs and released after it, and its gradients are
reduce-scattered as soon as its backward is done. FSDP2 does that in hooks around a module's call, so
the block must be one call of a module that reads its parameters inside it. This pass builds that
program; what the call does is set by the layer that runs it (`BlockCall.enter`).

A block qualifies when its nodes are one run of consecutive nodes of the program, its own
parameters (those under its module path) are read only inside that run, and it reads no other
block's parameters (a module shared by two blocks runs with the rest of the program). `unit_blocks` lists them,
in program order; `unit_program` rewrites a program for a given list, or says it cannot (a later
program of the same model, for other shapes or eval mode, in which a block is split in two runs).

>>> import torch
>>> from collections import OrderedDict
>>> from torch.nn import Linear, Sequential, Tanh
>>> from passes.capture.export import capture
>>> net = Sequential(OrderedDict(h=Sequential(Sequential(Linear(4, 4), Tanh()), Sequential(Linear(4, 4), Tanh()))))
>>> cap = capture(net, (torch.randn(2, 4),))
>>> unit_blocks(cap.gm, cap.sources)
['h.0', 'h.1']
>>> gm = unit_program(cap.gm, cap.sources, ['h.0', 'h.1'])
>>> [(m.name, m.keys) for m in gm.children() if isinstance(m, BlockCall)]
[('h.0', ('h.0.0.weight', 'h.0.0.bias')), ('h.1', ('h.1.0.weight', 'h.1.0.bias'))]
"""

from __future__ import annotations

import torch.nn as nn
from torch.fx import GraphModule

from passes.errors import UsageError
from passes.nodes import block_of, block_path
from passes.transforms.recompute import block_runs, boundary, group_runs, region_body

__all__ = ["BlockCall", "unit_blocks", "unit_program"]


class BlockCall(nn.Module):
    """One repeated block of a program: `body(*inputs, *params)`, where `params` are the blocks of the
    parameters named `keys`, which the call fetches. `enter(self, *inputs)` runs it; the layer that
    runs the program sets it (until then the call raises)."""

    def __init__(self, body: GraphModule, name: str, keys: tuple):
        super().__init__()
        self.body, self.name, self.keys = body, name, keys
        self.enter = None

    def forward(self, *inputs):
        if self.enter is None:
            raise UsageError(f"block {self.name!r}: this program's block calls were not given a way to fetch "
                             f"their parameters: set BlockCall.enter before running it (autopar.parallel.sharded "
                             f"does for sharded replicas)")
        return self.enter(self, *inputs)

    def extra_repr(self) -> str:
        return self.name


def _param_keys(gm: GraphModule, sources: list) -> dict:
    """placeholder node -> parameter name, for the parameters among `gm`'s inputs."""
    places = gm.graph.find_nodes(op="placeholder")
    return {n: key for n, (role, key) in zip(places, sources) if role == "param"}


def _runs(gm: GraphModule, sources: list) -> dict:
    """block -> its run of nodes, for each block that qualifies (see the module docstring)."""
    params = _param_keys(gm, sources)
    seen: dict[str | None, list] = {}
    for run in block_runs(gm):
        if run:
            seen.setdefault(block_of(run[0]), []).append(run)
    out = {}
    for block, runs in seen.items():
        if block is None or len(runs) != 1:  # outside blocks, or a block run in two pieces
            continue
        inside = set(runs[0])
        own = [p for p, key in params.items() if key.startswith(block + ".")]
        # a module used under two names (ALBERT's shared layer): its parameters carry the first name only,
        # so the second block reads another block's parameters; neither can be a unit of its own
        foreign = [key for p, key in params.items() if set(p.users) & inside and block_path(key) not in (None, block)]
        if all(set(p.users) <= inside for p in own) and not foreign:
            out[block] = runs[0]
    return out


def unit_blocks(gm: GraphModule, sources: list) -> list:
    """The blocks of `gm` (a per-rank program; `sources` its placeholders' (role, key)) that can run as
    one call reading their own parameters, in program order."""
    return list(_runs(gm, sources))


def unit_program(gm: GraphModule, sources: list, blocks: list) -> GraphModule | None:
    """`gm` with each of `blocks` that it runs replaced by a `BlockCall`; its placeholders stay as they
    are (those of the blocks' own parameters are then unused). None when one of `blocks` is run by
    `gm` but does not qualify."""
    runs = _runs(gm, sources)
    present = {block_of(n) for n in gm.graph.nodes if n.op in ("call_function", "call_module")}
    if any(b in present and b not in runs for b in blocks):
        return None
    params = _param_keys(gm, sources)
    chosen = [runs[b] for b in blocks if b in runs]

    def wrap(i: int, run: list) -> tuple:
        block = block_of(run[0]) or ""  # every chosen run is a block's
        inputs, outputs = boundary(run)
        own = [a for a in inputs if params.get(a, "").startswith(block + ".")]
        rest = [a for a in inputs if a not in own]
        body = region_body(gm, run, rest + own, outputs)
        return f"autopar_unit_{i}", BlockCall(body, block, tuple(params[a] for a in own)), rest, outputs

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return group_runs(gm, sorted(chosen, key=lambda run: order[run[-1]]), wrap)
