"""A ParallelModule's programs: one compiled per input signature (shapes, dtypes, keywords, train or eval),
the first being parallelize's. A call with a new signature captures the source model again and compiles it
with every parameter's stored layout pinned and the first program's strategy='auto' choice repeated, so that
the parameter blocks serve every program; a parameter whose shape changed since parallelize is refused."""

from __future__ import annotations

import types

import torch

from autopar.errors import UnsupportedError
from autopar.program.build import Compiled, compile_program, signature
from autopar.program.guards import check_dtypes
from passes.capture.export import flatten_inputs
from passes.compat import pytree
from passes.meta import PARAM

__all__ = ["ProgramCache"]


class ProgramCache:
    """Input signature -> `Compiled`, for one ParallelModule (`source`: the model new signatures are captured
    from; `param_layouts`: the layouts every program keeps)."""

    def __init__(self, source, grid, options, first: Compiled, param_layouts: dict):
        self.source, self.grid, self.options = source, grid, options
        self.param_layouts = param_layouts
        self.programs = {first.signature: first}
        self.last = first  # the program of the most recent call

    @property
    def first(self) -> Compiled:
        return next(iter(self.programs.values()))

    @property
    def view(self) -> types.MappingProxyType:
        return types.MappingProxyType(self.programs)

    def get(self, args, kwargs, training: bool, shape_of) -> tuple:
        """(the program for these inputs, compiled on first use, and the inputs flattened in its placeholder
        order). `shape_of(name)`: the shape a parameter had when the model was parallelized."""
        key = signature(args, kwargs, training)
        if key not in self.programs:  # a cached key already matched the dtypes of its compile
            same = next((c for k, c in self.programs.items() if k[1] == key[1]), None)  # same keywords
            if same is not None:
                check_dtypes(same, flatten_inputs(same.captured, args, kwargs))
            model, first = self.source, self.first
            was = model.training
            model.train(training)
            try:
                comp, _ = compile_program(model, args, kwargs, self.grid, self.options, first.choice,
                                          pinned=self.param_layouts)
            finally:
                model.train(was)
            self.check_parameters(comp, args, kwargs, shape_of)
            self.programs[key] = comp
        comp = self.programs[key]
        return comp, flatten_inputs(comp.captured, args, kwargs)

    def check_parameters(self, comp: Compiled, args, kwargs, shape_of) -> None:
        """A recompile keeps every parameter's stored layout (pinned); what it cannot keep is a parameter
        that is new or has another shape than when the model was parallelized."""
        for node in comp.captured.gm.graph.nodes:
            name = node.meta.get(PARAM)
            if name is None or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            now = tuple(node.meta["val"].shape)
            was = tuple(shape_of(name)) if name in self.param_layouts else None
            if now != was:
                shapes = [tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                raise UnsupportedError(
                    f"parameter {name!r} has shape {now} in a call with input shapes {shapes}, but "
                    + (f"shape {was} when the model was parallelized" if was else "did not exist when the model "
                       "was parallelized (a parameter created during a call)")
                    + "; its stored blocks cannot serve this call. Give it its final shape before parallelize "
                    "(run one call of the original model first), or call with the shapes it was parallelized for"
                )
