"""The R x C device grid and its two kinds of process groups.

Device (r, c) has global rank r*C + c (row-major, like DeviceMesh). Mesh axis 0 is indexed by the row
index r and axis 1 by the column index c. A collective *over axis 0* runs among the devices that share
a column index c; DeviceMesh calls that `get_group(0)`. To keep the two readings apart, this module
only ever says which index the group members share:

    grid.same_row_group  devices (r, 0..C-1)  -- collectives over mesh axis 1 (C members)
    grid.same_col_group  devices (0..R-1, c)  -- collectives over mesh axis 0 (R members)

Activations [b, s, h] are split batch over axis 0 and hidden over axis 1, so the LayerNorm statistics
are all-reduced in the same-row group and batch means in the same-column group.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from types import MappingProxyType
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from passes.compat import register_flattened_mesh
from passes.errors import AutoparWarning, UsageError

AXIS_NAMES = ("r", "c")  # mesh axis 0 is indexed by r, axis 1 by c
CP_AXIS = 2  # a collective's axis over the replicas when they split the sequence (context_parallel)
FLAT_NAME = "rc"  # both axes flattened: the grid's R*C ranks in row-major order


def warn(message: str, category: type[AutoparWarning], stacklevel: int = 1) -> None:
    """`warnings.warn`, shown by global rank 0 only: every rank compiles the same program and would
    print the same text once per rank. The other ranks still pass it through the warning filters
    (recorded, not shown), so a filter that turns it into an error raises on every rank alike and
    control flow never depends on the rank. Without a process group: an ordinary warning."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        with warnings.catch_warnings(record=True):
            warnings.warn(message, category, stacklevel=stacklevel + 1)
        return
    warnings.warn(message, category, stacklevel=stacklevel + 1)


@dataclass
class CommLog:
    """Bytes each collective *received* on this rank, and the collective calls it launched, keyed by
    (tag, phase): "fwd", "bwd", or "recompute" for a forward collective that backward runs again
    (`passes.transforms.recompute`).

    Conventions (per rank): broadcast of N bytes -> N on every non-root; reduce of N bytes -> (q-1)*N
    on the destination; all-gather of N bytes per rank -> (q-1)*N; reduce-scatter of an N-byte input
    -> (q-1)*N/q; all-reduce of N bytes -> 2*(q-1)*N/q (ring), floored (`passes.cost.volumes` writes
    them once, for the counters and the planner alike). Launches: one per collective call this
    rank makes, sender or receiver alike (a broadcast's root launches it too); a group of one member
    launches nothing. `order`: None, or a list to which each launch appends its (tag, phase), in the
    order this rank launched them (set it to [] to check that a compiled step keeps the eager order).
    """

    bytes: dict = field(default_factory=lambda: defaultdict(int))
    recomputing: int = 0  # > 0 while backward recomputes a region: its forward bytes count as "recompute"
    launches: dict = field(default_factory=lambda: defaultdict(int))
    order: list | None = None

    def add(self, tag: str, phase: str, nbytes: int) -> None:
        if self.recomputing and phase == "fwd":
            phase = "recompute"
        self.bytes[(tag, phase)] += int(nbytes)

    @contextlib.contextmanager
    def recomputing_region(self):
        """Count the collectives run inside as the recomputation of a forward (phase "recompute")."""
        self.recomputing += 1
        try:
            yield
        finally:
            self.recomputing -= 1

    def launch(self, tag: str, phase: str) -> None:
        if self.recomputing and phase == "fwd":
            phase = "recompute"
        self.launches[(tag, phase)] += 1
        if self.order is not None:
            self.order.append((tag, phase))

    def total(self, prefix: str = "") -> int:
        return sum(v for (tag, _), v in self.bytes.items() if tag.startswith(prefix))

    def calls(self, prefix: str = "", phase: str | None = None) -> int:
        """Collective calls launched by tags starting with `prefix` (in `phase` only, if given)."""
        return sum(v for (tag, ph), v in self.launches.items() if tag.startswith(prefix) and phase in (None, ph))

    def reset(self) -> None:
        self.bytes.clear()
        self.launches.clear()
        if self.order is not None:
            self.order.clear()


_GRIDS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # Grid.key -> the live grid
_KEYS = itertools.count()


def grid_of(key: int) -> "Grid":
    """The grid whose `key` is `key`: the traceable collectives (`passes.ops.library`) take a grid as
    this int, since a torch.library op's arguments are tensors and plain values."""
    grid = _GRIDS.get(key)
    assert grid is not None, f"no live Grid has key {key}: the grid of a compiled program was freed"
    return grid


def _register(grid: "Grid") -> None:
    grid.key = next(_KEYS)
    _GRIDS[grid.key] = grid



class _Groups(NamedTuple):
    """What `Grid` builds from torch.distributed for one grid shape (see `Grid._process_groups`)."""

    default: object  # the default process group they were built under
    mesh: DeviceMesh
    full_mesh: DeviceMesh | None  # dp > 1: the (dp, r, c) mesh `mesh` is a slice of
    same_col: object
    same_row: object
    dp: object
    world: object
    pp: object = None  # stages > 1: this grid position's group over the pipeline stages


_GROUPS: dict = {}  # (shape, dp, stages, device type, timeout) -> _Groups


class Grid:
    """An R x C grid over the default process group, with counted collectives; with dp > 1, dp such
    grids side by side (data parallel replicas: global rank = d*R*C + r*C + c); with stages > 1, that
    many pipeline stages of them (`autopar.parallel.pipeline`). `shape` is (R, C);
    `size(axis)` is the number of members of a collective over `axis`."""

    rank: int  # global rank
    dp_index: int  # which of the dp grids holds this rank
    r: int  # this rank's row in its grid
    c: int  # this rank's column in its grid
    same_col_group: Any  # process group over axis 0 (None without torch.distributed)
    same_row_group: Any  # over axis 1
    dp_group: Any  # over the replicas (dp > 1)
    world_group: Any  # this grid's R*C ranks; None: the default group (dp == 1, no timeout)
    full_mesh: Any  # dp > 1: the (dp, r, c) DeviceMesh whose (r, c) slice is `mesh`; else None
    stages: int  # pipeline stages (each holds dp grids): global rank = ((stage * dp) + d) * R * C + r * C + c
    stage: int  # which stage holds this rank
    pp_group: Any  # stages > 1: this grid position's group over the stages (None otherwise)
    key: int  # names this grid to the traceable collectives (`grid_of`)
    cube: "Cube | None" = None  # strategy='3d': the q x q x q cube this (q, q*q) grid is a view of
    # backward launches each SUMMA weight gradient's reduction before the input gradient's product and
    # waits for it after (`passes.ops.overlap`); False: one after the other. A compiled program keeps
    # the value it was traced with.
    overlap_grad_reduce: bool = True
    # SUMMA's broadcast and ring lowerings post the next panel's transfer before the current panel's matmul
    # (double buffering: one panel in flight), the all-gather lowering's AB both panels' gathers together; False:
    # each transfer is posted and waited for before what follows. The same calls, bytes and order either way.
    # Set, with overlap_grad_reduce, by the `overlap` option.
    prefetch: bool = True
    # context_parallel: replica d holds 1/cp of the sequence (zig-zag chunk pair d % cp) of batch d // cp; the cp
    # ranks' collectives run over axis CP_AXIS (`passes.ops.context`), in `cp_group` (None: all the replicas, dp_group)
    cp: int = 1
    cp_group: Any = None
    # graph node -> the module it came from ('model.layers.3.mlp.up_proj'), of the programs compiled on this
    # grid: the hang diagnosis names it (`passes.ops.flight`); replaced, never changed in place
    places: Mapping[str, str] = MappingProxyType({})

    def __init__(self, rows: int, cols: int, dp: int = 1, device_type: str = "cpu", timeout=None, stages: int = 1):
        shape = f"({dp}, {rows}, {cols})" if dp > 1 else f"({rows}, {cols})"
        if min(rows, cols, dp, stages) < 1:
            raise UsageError(f"grid={shape}: every entry must be a positive int")
        world = dist.get_world_size() if dist.is_initialized() else 1
        need = stages * dp * rows * cols
        if need != world:
            what = f"{stages} pipeline stages of grid={shape}" if stages > 1 else f"grid={shape}"
            raise UsageError(
                f"{what} needs {need} processes but the default process group has world size {world}. Start "
                f"{need} processes (torchrun --nproc-per-node {need}) or pick a grid whose size equals the world size."
            )
        self.shape, self.dp, self.stages = (rows, cols), dp, stages
        self.rank = dist.get_rank() if dist.is_initialized() else 0  # global
        self.stage: int = self.rank // (dp * rows * cols)
        rest = self.rank % (dp * rows * cols)
        self.dp_index, local = divmod(rest, rows * cols)
        self.r, self.c = divmod(local, cols)
        self.pp_group: Any = None
        self.device_type = device_type
        _register(self)
        self.log = CommLog()
        self.timeout = timeout
        if not dist.is_initialized():
            self.mesh: DeviceMesh | None = None
            self.full_mesh = None
            self.same_col_group = self.same_row_group = self.dp_group = self.world_group = None
        else:
            self._adopt(self._process_groups())

    @property
    def device(self) -> torch.device:
        """Where the tensors this grid's collectives move live: the current device of an accelerator
        (NCCL's, set by torch.cuda.set_device), else the device type's."""
        if self.device_type not in ("cpu", "meta") and torch.accelerator.is_available():
            return torch.device(self.device_type, torch.accelerator.current_device_index())
        return torch.device(self.device_type)

    def _process_groups(self) -> "_Groups":
        """The process groups and DeviceMesh of this grid's shape, built once per shape, replica count,
        device type and timeout under the current default group, then shared by every Grid of that
        kind. A gloo group keeps two threads per member process alive until the process group is
        destroyed, so a program (or a test pool) that parallelizes many models must not build new
        ones each time."""
        key = (self.shape, self.dp, self.stages, self.device_type, self.timeout)
        got = _GROUPS.get(key)
        if got is not None and got.default is dist.group.WORLD:  # not from a destroyed default group
            return got
        self.dp_group = self.world_group = self.full_mesh = None
        rows, cols = self.shape
        if self.timeout is not None or self.stages > 1:  # explicit groups: each stage's grids, the stages
            self._build_with_timeout(self.timeout)
        else:
            if self.dp > 1:
                full = init_device_mesh(self.device_type, (self.dp, rows, cols), mesh_dim_names=("dp",) + AXIS_NAMES)
                mesh = full[AXIS_NAMES]
                self.full_mesh = full
                self.dp_group = full.get_group("dp")
                for d in range(self.dp):  # every rank creates every group, in the same order
                    group = dist.new_group(self._grid_ranks(d))
                    if d == self.dp_index:
                        self.world_group = group
            else:
                mesh = init_device_mesh(self.device_type, (rows, cols), mesh_dim_names=AXIS_NAMES)
            self.mesh = mesh
            self.same_col_group = mesh.get_group(0)
            self.same_row_group = mesh.get_group(1)
        self._flatten_mesh(self.mesh)
        got = _GROUPS[key] = _Groups(dist.group.WORLD, self.mesh, self.full_mesh, self.same_col_group,
                                     self.same_row_group, self.dp_group, self.world_group, self.pp_group)
        return got

    def _adopt(self, groups: "_Groups") -> None:
        self.mesh, self.same_col_group, self.same_row_group = groups.mesh, groups.same_col, groups.same_row
        self.full_mesh = groups.full_mesh
        self.dp_group, self.world_group, self.pp_group = groups.dp, groups.world, groups.pp

    @property
    def base(self) -> int:
        """The global rank of position (0, 0) of this rank's grid."""
        return (self.stage * self.dp + self.dp_index) * self.world

    def _grid_ranks(self, d: int, stage: int | None = None) -> list:
        base = ((self.stage if stage is None else stage) * self.dp + d) * self.world
        return list(range(base, base + self.world))

    @classmethod
    def for_planning(cls, rows: int, cols: int | None = None, dp: int = 1) -> "Grid":
        """A grid with no process groups, for building and costing a plan on one process (as rank
        (0, 0)); its collectives cannot run."""
        g = cls.__new__(cls)
        g.shape, g.dp, g.rank, g.dp_index, g.r, g.c = (rows, rows if cols is None else cols), dp, 0, 0, 0, 0
        g.stages, g.stage, g.pp_group = 1, 0, None
        g.device_type, g.log, g.mesh, g.dp_group, g.timeout, g.world_group = "cpu", CommLog(), None, None, None, None
        g.full_mesh = None
        g.same_row_group = g.same_col_group = None
        _register(g)
        return g

    def _build_with_timeout(self, timeout) -> None:
        """Every group this grid uses (rows, columns, the grid, the replicas) created with `timeout`, and
        the DeviceMesh built on them, so that DTensor's own collectives (`full_tensor`, the norm in
        `clip_grad_norm_`, a checkpoint's gathers) give up after `timeout` too. Every rank creates every
        group, in the same order (torch.distributed requires it)."""
        (R, C), dp, mine = self.shape, self.dp, {}
        for stage in range(self.stages):
            for d in range(dp):
                base = (stage * dp + d) * R * C
                for kind in ("row", "col"):
                    for i in range(R if kind == "row" else C):
                        others = range(C if kind == "row" else R)
                        ranks = [base + (i * C + j if kind == "row" else j * C + i) for j in others]
                        group = dist.new_group(ranks, timeout=timeout)
                        if self.rank in ranks:
                            mine[kind] = group
                group = dist.new_group(self._grid_ranks(d, stage), timeout=timeout)
                if (stage, d) == (self.stage, self.dp_index):
                    self.world_group = group
            if dp > 1:
                for i in range(R * C):
                    ranks = [(stage * dp + d) * R * C + i for d in range(dp)]
                    group = dist.new_group(ranks, timeout=timeout)
                    if self.rank in ranks:
                        self.dp_group = group
        if self.stages > 1:
            for i in range(dp * R * C):
                ranks = [stage * dp * R * C + i for stage in range(self.stages)]
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.pp_group = group
        self.same_row_group, self.same_col_group = mine["row"], mine["col"]
        ids = torch.arange(dp * R * C).reshape(dp, R, C) + self.stage * dp * R * C  # this stage's ranks
        if dp > 1:  # one (dp, r, c) mesh, the grid's a slice of it (FSDP2 needs both from one root)
            self.full_mesh = DeviceMesh.from_group([self.dp_group, self.same_col_group, self.same_row_group],
                                                   self.device_type, mesh=ids, mesh_dim_names=("dp",) + AXIS_NAMES)
            self.mesh = self.full_mesh[AXIS_NAMES]
        else:
            self.mesh = DeviceMesh.from_group([self.same_col_group, self.same_row_group], self.device_type,
                                              mesh=ids[0], mesh_dim_names=AXIS_NAMES)

    def _flatten_mesh(self, mesh: DeviceMesh) -> None:
        """Give DTensor the grid's own R*C group as the mesh flattened over both axes, so that a
        reduction of a value partial on both axes (the total norm in torch's `clip_grad_norm_` over our
        DTensor gradients) is one all-reduce over the grid instead of one per axis, which DTensor warns
        about on every rank ("2 sequential all_reduce operations ... may give inconsistent results").
        The group is `world_group` (built with `timeout` when one is given) or the default group: no
        new group, and the bound on DTensor's collectives holds. torch looks flattened meshes up in the
        root mesh's `_flatten_mapping` by layout; `DeviceMesh._flatten` would build a group without
        our timeout."""
        group = self.world_group or dist.group.WORLD
        ranks = self._grid_ranks(self.dp_index)
        flat = DeviceMesh.from_group(group, self.device_type, mesh=ranks, mesh_dim_names=(FLAT_NAME,))
        register_flattened_mesh(mesh, FLAT_NAME, flat)

    def group(self, axis: int):
        """Process group of a collective over mesh `axis` (0: same column, 1: same row)."""
        if axis == CP_AXIS:
            return self.dp_group if self.cp_group is None else self.cp_group
        return self.same_col_group if axis == 0 else self.same_row_group

    def size(self, axis: int) -> int:
        """Members of a collective over mesh `axis`: R for axis 0, C for axis 1."""
        return self.cp if axis == CP_AXIS else self.shape[axis]

    @property
    def world(self) -> int:
        """Ranks in one grid (R*C)."""
        return self.shape[0] * self.shape[1]

    def index(self, axis: int) -> int:
        """This rank's position inside the group of `axis` (r for axis 0, c for axis 1)."""
        if axis == CP_AXIS:
            return self.cp_index
        return self.r if axis == 0 else self.c

    @property
    def cp_index(self) -> int:
        """Which of its batch's cp ranks this rank is (context_parallel: its chunk pair)."""
        return self.dp_index % self.cp

    @property
    def batch_index(self) -> int:
        """Which of the dp // cp data-parallel batches this rank trains on (its replica's, without cp)."""
        return self.dp_index // self.cp

    def global_rank(self, axis: int, i: int) -> int:
        """Global rank of member i of this rank's group over `axis`."""
        C = self.shape[1]
        if axis == CP_AXIS:  # the same (r, c) in cp copy i of this rank's batch
            return (self.stage * self.dp + self.batch_index * self.cp + i) * self.world + self.r * C + self.c
        return self.base + (i * C + self.c if axis == 0 else self.r * C + i)

    def __repr__(self) -> str:
        return f"Grid({self.shape[0]}x{self.shape[1]}, rank={self.rank}, (r, c)=({self.r}, {self.c}))"


_CUBE_GROUPS: dict = {}  # (q, device type, timeout) -> (default group, {("row" | "depth", a, b): group, "mesh": ...})


class Cube:
    """A q x q x q grid for 3D tensor parallelism (`passes.ops.cube`): device (r, c, l) has global rank
    r*q*q + c*q + l. `grid` is the same devices as the 2D grid (q, q*q) whose column index j = c*q + l
    names (c, l), c outer: what holds an activation split over the columns holds it split over c, then
    over l. `depth` is the q x q grid of the devices at this rank's depth l: its rows are (r, 0..q-1, l),
    its columns (0..q-1, c, l) (the 2D grid's column groups). `depth_group` holds (r, c, 0..q-1)."""

    def __init__(self, q: int, device_type: str = "cpu", grid: "Grid | None" = None):
        """`grid`: the (q, q*q) grid to build on (default: a new one); the cube is attached to it as
        `grid.cube`, so the kernels built for that grid find it."""
        if q < 1:
            raise UsageError(f"a cube of side {q}: the side must be a positive int")
        self.q = q
        self.grid = Grid(q, q * q, device_type=device_type) if grid is None else grid
        assert self.grid.shape == (q, q * q) and self.grid.dp == 1 and self.grid.stages == 1, self.grid
        self.r, self.c, self.l = self.grid.r, self.grid.c // q, self.grid.c % q
        timeout = self.grid.timeout  # the depth collectives give up when the grid's do
        key = (q, device_type, timeout)
        got = _CUBE_GROUPS.get(key)
        if got is None or got[0] is not dist.group.WORLD:
            groups: dict = {}
            for a in range(q):  # every rank creates every group, in the same order
                for b in range(q):
                    groups["row", a, b] = dist.new_group([a * q * q + i * q + b for i in range(q)],  # (a, ., b)
                                                         timeout=timeout)
                    groups["depth", a, b] = dist.new_group([a * q * q + b * q + i for i in range(q)],  # (a, b, .)
                                                           timeout=timeout)
            groups["mesh"] = init_device_mesh(device_type, (q, q, q), mesh_dim_names=("r", "c", "l"))
            got = _CUBE_GROUPS[key] = (dist.group.WORLD, groups)
        groups = got[1]
        self.depth_group = groups["depth", self.r, self.c]
        self.mesh = groups["mesh"]  # the (r, c, l) DeviceMesh a cube weight's DTensor lives on
        self.depth = _DepthGrid(self, groups["row", self.r, self.l])
        self.grid.cube = self

    @property
    def log(self) -> CommLog:
        return self.grid.log

    def index(self, axis: int) -> int:
        """This rank's position along cube axis 0 (r), 1 (c) or 2 (l)."""
        return (self.r, self.c, self.l)[axis]

    def size(self, axis: int) -> int:
        return self.q

    def __repr__(self) -> str:
        q = self.q
        return f"Cube({q}x{q}x{q}, rank={self.grid.rank}, (r, c, l)=({self.r}, {self.c}, {self.l}))"


class _DepthGrid(Grid):
    """The q x q grid of a cube's devices at one depth l, for the SUMMA products (`passes.ops.summa`):
    position (r, c), rows over (r, ., l), columns over (., c, l); its collectives count in the cube's log."""

    def __init__(self, cube: Cube, row_group):
        q, parent = cube.q, cube.grid
        self.shape, self.dp, self.stages, self.stage, self.dp_index = (q, q), 1, 1, 0, 0
        self.rank, self.r, self.c, self.depth = parent.rank, cube.r, cube.c, cube.l
        self.log, self.device_type, self.timeout = parent.log, parent.device_type, None
        self.mesh = self.full_mesh = self.world_group = self.dp_group = self.pp_group = None
        self.same_col_group, self.same_row_group = parent.same_col_group, row_group
        self._parent = parent
        _register(self)

    @property
    def prefetch(self) -> bool:  # type: ignore[override]  # the cube's grid decides (the `overlap` option)
        return self._parent.prefetch

    @property
    def overlap_grad_reduce(self) -> bool:  # type: ignore[override]
        return self._parent.overlap_grad_reduce

    def global_rank(self, axis: int, i: int) -> int:
        q = self.shape[0]
        return (i * q + self.c) * q + self.depth if axis == 0 else (self.r * q + i) * q + self.depth
