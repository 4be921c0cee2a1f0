"""Sharded replicas: `grid=(dp, R, C), data_parallel="shard"` splits every grid block over the replicas.

With `"replicate"` each of the dp replicas holds its R x C grid block of every parameter, gradient and
optimizer state whole, and the replicas all-reduce the gradients. With `"shard"`, FSDP2's
`fully_shard` (ZeRO-3, as torchtitan composes it with tensor parallelism) splits each block once more,
over the replica axis of the grid's (dp, r, c) mesh: a rank holds 1/(dp*R*C) of every parameter
between steps, as a DTensor on that mesh (placements `(_StridedShard or Shard over dp, <the grid's
two>)`), and so do its gradient and the optimizer's state, which torch optimizers, `clip_grad_norm_`
and torch.distributed.checkpoint read as they are.

FSDP2 does the gathering, per unit: each repeated block that the program runs as one call
(`passes.transforms.units`: `model.layers.3`, ...) is a unit of its own, and the root (the
ParallelModule: embeddings, final norm, LM head, whatever is outside the blocks) one more. A block's
container module takes the class `_Unit`, whose forward runs the program's call of the block on its own
parameters' grid blocks, so FSDP2's hooks around that call all-gather them over the replicas just
before the block runs, release them after its forward (`reshard_after_forward`, True: FSDP2's default),
gather them again for its backward, and reduce-scatter its gradients when its backward is done. The
root is gathered from its forward to the end of backward (FSDP2 does not reshard a root after
forward). `fsdp_prefetch=k` sets each block's explicit forward and backward prefetching to the next k
blocks. A later program in which a block is not one call (`program_for` says so) runs with every unit
gathered for it (`gathered`).

Per rank and step the replica axis receives `replica_traffic(pmodel)`: each unit's all-gather brings
(dp - 1)/dp of its padded grid blocks (FSDP2 pads each block's first dim to a multiple of dp), twice
for a block resharded after forward, and its reduce-scatter the same share of every trained
parameter's gradient block, one call each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from autopar.errors import PlanWarning, UsageError
from autopar.parallel.replicas import Replicas
from passes.transforms.units import BlockCall, unit_blocks, unit_program
from passes.compat import FSDPAllGather, FSDPReduceScatter, all_gather_single, in_backward, reduce_scatter_single
from passes.cost.replicas import FSDPTraffic, fsdp_traffic, shard_rows, unit_groups
from passes.cost.volumes import all_gather_bytes, reduce_scatter_bytes
from passes.mesh import warn
from passes.nodes import block_of
from passes.ops.comm import guarded, tensor_bytes

__all__ = ["Sharded", "shard_replicas", "program_for", "gathered", "units", "is_sharded",
           "refuse_foreign_sharding", "replica_traffic", "memory_per_rank",
           "grid_placements", "replica_shard", "is_cube_weight"]

class Sharded(Replicas):
    """The shard mode's state of one ParallelModule (`pmodel.replicas` once `shard_replicas` ran): what
    FSDP2 was given and the programs rewritten for its units."""


    def __init__(self, pmodel, blocks: dict, units: tuple):
        super().__init__(pmodel.grid, pmodel.options)
        self.blocks = blocks  # name -> (grid block shape, element size, trained) before sharding
        self.units = units  # the repeated blocks that are FSDP2 units, in program order
        self.programs: dict = {}  # signature -> (program with block calls, names the calls fetch)
        self._module = weakref.ref(pmodel)  # the module owns this record

    def program(self, comp) -> tuple:
        """(the program to run for `comp` on sharded replicas, the parameter names its block calls fetch
        themselves). A program whose blocks cannot be calls runs as it is, every unit gathered for it
        (`around`), and fetches nothing itself."""
        if comp.signature not in self.programs:
            gm = unit_program(comp.gm, comp.captured.sources, list(self.units)) if self.units else None
            if gm is None:
                self.programs[comp.signature] = comp, frozenset()
            else:
                calls = [m for m in gm.children() if isinstance(m, BlockCall)]
                for call in calls:
                    call.enter = functools.partial(_enter, self._module)
                keys = frozenset(k for call in calls for k in call.keys)
                self.programs[comp.signature] = dataclasses.replace(comp, gm=gm), keys
        return self.programs[comp.signature]

    def around(self, comp, run):
        """A program whose blocks are not calls of their FSDP2 units: every unit gathered for it."""
        return gathered(self._module(), not torch.is_grad_enabled()) if run is comp else contextlib.nullcontext()

    def generating(self):
        """Generation: every unit gathered for the call and released after it."""
        return gathered(self._module(), release=True)

    def traffic(self) -> FSDPTraffic:
        """The all-gather and reduce-scatter over the replicas of one training step on this rank, from the
        parameters' grid blocks: (dp - 1)/dp of each block padded to a multiple of dp on its first dim."""
        return fsdp_traffic(unit_groups(self.blocks, self.units), self.grid.dp, self.options.reshard_after_forward)


def shard_replicas(pmodel) -> None:
    """Split `pmodel`'s grid blocks over its dp replicas with FSDP2 (`data_parallel="shard"`): one unit per
    repeated block that its program runs as one call (`passes.transforms.units`), then the root for the
    rest. On a grid of one replica nothing is split, with a warning."""
    grid, options = pmodel.grid, pmodel.options
    if grid.dp == 1:
        warn(f"data_parallel='shard' on a grid of one replica (grid {grid.shape[0]}x{grid.shape[1]}): there is no "
             f"replica axis to shard over, so every rank keeps its grid block whole. Pass grid=(dp, R, C) with "
             f"dp > 1 to shard, or leave data_parallel out.", PlanWarning, stacklevel=3)
        return
    blocks = {n: (tuple(p.to_local().shape), p.element_size(), p.requires_grad) for n, p in pmodel.named_parameters()}
    mesh, comp = grid.full_mesh["dp"], pmodel.program
    names = []
    for name in unit_blocks(comp.gm, comp.captured.sources):
        container = pmodel.get_submodule(name)
        if type(container) is nn.Module and any(True for _ in container.parameters()):
            container.__class__ = _Unit  # its forward runs a program's call of the block
            names.append(name)
    others = sorted({block_of(n) for n in comp.gm.graph.nodes if n.op == "call_function"} - {None} - set(names))
    if others:
        warn(f"data_parallel='shard': blocks {others} are not FSDP2 units of their own (a module shared by two "
             f"blocks, as ALBERT shares its layer, or a block whose parameters are read outside it): their "
             f"parameters are gathered with the root's and held from the forward to the backward",
             PlanWarning, stacklevel=3)
    blocks_ = [pmodel.get_submodule(n) for n in names]
    for unit in blocks_:
        fully_shard(unit, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
    fully_shard(pmodel, mesh=mesh)  # FSDP2's default for the root: gathered from its forward to its backward
    for unit in [*blocks_, pmodel]:
        unit.set_custom_all_gather(_CountedAllGather(grid))
        unit.set_custom_reduce_scatter(_CountedReduceScatter(grid))
    k = options.fsdp_prefetch
    if k is not None:
        for i, unit in enumerate(blocks_):
            unit.set_modules_to_forward_prefetch(blocks_[i + 1:i + 1 + k])
            unit.set_modules_to_backward_prefetch(blocks_[max(0, i - k):i][::-1])
    pmodel.replicas = Sharded(pmodel, blocks, tuple(names))


class _Unit(nn.Module):
    """The class of a repeated block's parameter container once it is an FSDP2 unit: called with one of
    a program's `BlockCall`s, it runs the block's body on its own parameters' grid blocks (FSDP2 has
    gathered them over the replicas in its pre-forward hook)."""

    def forward(self, call: BlockCall, *inputs):
        skip = len(call.name) + 1
        return call.body(*inputs, *(self.get_parameter(k[skip:]).to_local() for k in call.keys))


def program_for(pmodel, comp):
    """`Sharded.program` of a sharded ParallelModule."""
    return pmodel.replicas.program(comp)


def _enter(ref, call: BlockCall, *inputs):
    """A block call: through its FSDP2 unit's __call__, so that FSDP2's hooks gather and release it."""
    return ref().get_submodule(call.name)(call, *inputs)


def units(pmodel) -> list:
    """The FSDP2 units of a sharded ParallelModule: each repeated block's, then the root."""
    return [*(pmodel.get_submodule(n) for n in pmodel.replicas.units), pmodel]


@contextlib.contextmanager
def gathered(pmodel, release: bool):
    """Every unit's parameters gathered over the replicas (for generation, and for a program whose
    blocks are not calls). `release`: reshard them after (without grad; with grad FSDP2 reshards each
    unit after its gradients are reduce-scattered)."""
    every = units(pmodel)
    for unit in every:
        unit.unshard()
    try:
        yield
    finally:
        if release:
            for unit in every:
                unit.reshard()


class _CountedAllGather(FSDPAllGather):
    """FSDP2's all-gather of a unit's parameter shards, counted in the grid's CommLog ("fsdp:" tags); a
    failure is a CollectiveError naming it (`passes.ops.comm.guarded`)."""

    def __init__(self, grid):
        self.grid = grid

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        phase = "bwd" if in_backward() else "fwd"  # a block gathered again for its backward
        self.grid.log.launch("fsdp:all-gather", phase)
        self.grid.log.add("fsdp:all-gather", phase, all_gather_bytes(tensor_bytes(input_tensor), self.grid.dp))
        with guarded(self.grid, "FSDP2 all-gather of a unit's parameter shards", "dp", f"fsdp:all-gather {phase}"):
            _done(all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op))


class _CountedReduceScatter(FSDPReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients, counted in the grid's CommLog ("fsdp:" tags); a
    failure is a CollectiveError naming it."""

    def __init__(self, grid):
        self.grid = grid

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.grid.log.launch("fsdp:reduce-scatter", "bwd")
        self.grid.log.add("fsdp:reduce-scatter", "bwd",
                          reduce_scatter_bytes(tensor_bytes(input_tensor), self.grid.dp))
        with guarded(self.grid, "FSDP2 reduce-scatter of a unit's gradients", "dp", "fsdp:reduce-scatter"):
            _done(reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                        async_op=async_op))


def _done(work) -> None:
    """Wait for an FSDP2 collective inside its guard, so that a peer's failure or a timeout is a
    CollectiveError naming it (waited for by FSDP2 itself it surfaced as the backend's raw error).
    FSDP2 then sees no work handle and treats the collective as done; on a GPU the wait orders the
    stream, it does not block the host."""
    if work is not None:
        work.wait()


def is_sharded(pmodel) -> bool:
    """Whether autopar split `pmodel`'s blocks over its replicas (data_parallel='shard', dp > 1)."""
    return isinstance(getattr(pmodel, "replicas", None), Sharded)


def refuse_foreign_sharding(pmodel) -> None:
    """A ParallelModule wrapped in FSDP2's `fully_shard` by its caller (or whose parameters an enclosing
    module's `fully_shard` took over) has parameters on a mesh autopar did not plan, and its replicas
    would also all-reduce what FSDP reduce-scatters: refused, on every rank, before the program runs."""
    if is_sharded(pmodel):
        return
    foreign = isinstance(pmodel, FSDPModule)
    if not foreign:
        p = next(pmodel.parameters(), None)
        cube = getattr(pmodel.grid.cube, "mesh", None)  # strategy='3d': a 3D linear's weight is on the cube's mesh
        foreign = isinstance(p, DTensor) and p.device_mesh not in (pmodel.grid.mesh, cube) and p.device_mesh.ndim != 2
    if foreign:
        raise UsageError(
            "this ParallelModule was wrapped in FSDP2's fully_shard after parallelize: autopar shards the "
            "replicas of its grid itself. Build it with autopar.parallelize(model, grid=(dp, R, C), "
            "data_parallel='shard', ...) instead of calling fully_shard on the result")


def replica_traffic(pmodel) -> FSDPTraffic:
    """`Sharded.traffic` of a sharded ParallelModule."""
    return pmodel.replicas.traffic()


def is_cube_weight(tensor) -> bool:
    """Whether a parameter is a 3D linear's weight, a DTensor on a cube's (r, c, l) mesh (strategy='3d')."""
    mesh = getattr(tensor, "device_mesh", None)
    return mesh is not None and tuple(mesh.mesh_dim_names or ()) == ("r", "c", "l")


def grid_placements(tensor) -> tuple:
    """A parameter's placements over the grid's two axes (a sharded replica's first one, over the
    replicas, left out), or a 3D linear's weight's over the cube's three; () for a plain tensor."""
    placements = tuple(getattr(tensor, "placements", ()))
    return placements[-2:] if len(placements) == 3 and not is_cube_weight(tensor) else placements


def replica_shard(tensor, block: torch.Tensor, dp_index: int, dp: int) -> torch.Tensor:
    """This rank's part of its grid `block` of parameter `tensor`: the block itself, or for sharded
    replicas (three placements) the dp_index-th of FSDP2's chunks of its first dim (ceil(rows/dp) rows
    each, the last shorter), which is what the shard holds."""
    if len(tuple(getattr(tensor, "placements", ()))) != 3 or is_cube_weight(tensor):
        return block
    rows = block.shape[0]
    size = shard_rows(rows, dp)
    piece = block[min(dp_index * size, rows):min((dp_index + 1) * size, rows)]
    local = tensor.to_local()
    assert piece.shape == local.shape, f"replica shard {tuple(piece.shape)} of block {tuple(block.shape)} is not " \
                                       f"the parameter's local {tuple(local.shape)}"
    return piece


def memory_per_rank(pmodel, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds between steps: its parameter, gradient and optimizer-state shards."""
    def held(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(pmodel.parameters())
    states = [] if optimizer is None else [v for st in optimizer.state.values() for v in st.values()
                                           if isinstance(v, torch.Tensor) and v.dim() > 0]  # not Adam's step
    return {"params": sum(map(held, params)), "grads": sum(held(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(map(held, states))}
