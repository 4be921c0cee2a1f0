"""The q x q device grid and its two kinds of process groups.

Device (r, c) has global rank r*q + c (row-major, like DeviceMesh). Mesh axis 0 is indexed by the row
index r and axis 1 by the column index c. A collective *over axis 0* runs among the devices that share
a column index c; DeviceMesh calls that `get_group(0)`. To keep the two readings apart, this module
only ever says which index the group members share:

    grid.same_row_group  devices (r, 0..q-1)  -- collectives over mesh axis 1
    grid.same_col_group  devices (0..q-1, c)  -- collectives over mesh axis 0

Activations [b, s, h] are split batch over axis 0 and hidden over axis 1, so the LayerNorm statistics
are all-reduced in the same-row group and batch means in the same-column group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXIS_NAMES = ("r", "c")  # mesh axis 0 is indexed by r, axis 1 by c


@dataclass
class CommLog:
    """Bytes each collective *received* on this rank, keyed by (tag, phase).

    Conventions (per rank): broadcast of N bytes -> N on every non-root; reduce of N bytes -> (q-1)*N
    on the destination; all-gather of N bytes per rank -> (q-1)*N; reduce-scatter of an N-byte input
    -> (q-1)*N/q; all-reduce of N bytes -> 2*(q-1)*N/q (ring).
    """

    bytes: dict = field(default_factory=lambda: defaultdict(int))
    calls: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, tag: str, phase: str, nbytes: int) -> None:
        self.bytes[(tag, phase)] += int(nbytes)
        self.calls[(tag, phase)] += 1

    def total(self, prefix: str = "") -> int:
        return sum(v for (tag, _), v in self.bytes.items() if tag.startswith(prefix))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class Grid:
    """A square q x q grid over the default process group, with counted collectives; with dp > 1,
    dp such grids side by side (data parallel replicas: global rank = d*q*q + r*q + c)."""

    def __init__(self, rows: int, cols: int, dp: int = 1, device_type: str = "cpu", timeout=None):
        shape = f"({dp}, {rows}, {cols})" if dp > 1 else f"({rows}, {cols})"
        if min(rows, cols, dp) < 1:
            raise ValueError(f"grid={shape}: every entry must be a positive int")
        if rows != cols:
            raise ValueError(
                f"grid={shape} is not square: the SUMMA engine needs a q x q grid. "
                f"Use grid=(q, q) with q*q processes (for example (2, 2) with 4)."
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dp * rows * cols != world:
            raise ValueError(
                f"grid={shape} needs {dp * rows * cols} processes but the default process group "
                f"has world size {world}. Start {dp * rows * cols} processes (torchrun --nproc-per-node "
                f"{dp * rows * cols}) or pick a grid whose size equals the world size."
            )
        self.q, self.dp = rows, dp
        self.rank = dist.get_rank() if dist.is_initialized() else 0  # global
        self.dp_index, local = divmod(self.rank, rows * cols)
        self.r, self.c = divmod(local, self.q)
        self.device_type = device_type
        self.log = CommLog()
        self.dp_group = None
        if dp > 1:
            full = init_device_mesh(device_type, (dp, rows, cols), mesh_dim_names=("dp",) + AXIS_NAMES)
            self.mesh: DeviceMesh | None = full[AXIS_NAMES]
            self.dp_group = full.get_group("dp")
        elif dist.is_initialized():
            self.mesh = init_device_mesh(device_type, (rows, cols), mesh_dim_names=AXIS_NAMES)
        else:
            self.mesh = None
        if self.mesh is not None and timeout is not None:
            self.same_row_group, self.same_col_group = self._groups_with_timeout(timeout)
        elif self.mesh is not None:
            self.same_col_group = self.mesh.get_group(0)
            self.same_row_group = self.mesh.get_group(1)
        else:
            self.same_col_group = self.same_row_group = None

    @classmethod
    def for_planning(cls, q: int, dp: int = 1) -> "Grid":
        """A grid with no process groups, for building and costing a plan on one process (as rank
        (0, 0)); its collectives cannot run."""
        g = cls.__new__(cls)
        g.q, g.dp, g.rank, g.dp_index, g.r, g.c = q, dp, 0, 0, 0, 0
        g.device_type, g.log, g.mesh, g.dp_group = "cpu", CommLog(), None, None
        g.same_row_group = g.same_col_group = None
        return g

    def _groups_with_timeout(self, timeout):
        """Row and column groups of their own, whose collectives give up after `timeout`."""
        q, mine = self.q, {}
        for d in range(self.dp):
            base = d * q * q
            for kind in ("row", "col"):
                for i in range(q):
                    ranks = [base + (i * q + j if kind == "row" else j * q + i) for j in range(q)]
                    group = dist.new_group(ranks, timeout=timeout)  # every rank creates every group
                    if self.rank in ranks:
                        mine[kind] = group
        return mine["row"], mine["col"]

    def group(self, axis: int):
        """Process group of a collective over mesh `axis` (0: same column, 1: same row)."""
        return self.same_col_group if axis == 0 else self.same_row_group

    def index(self, axis: int) -> int:
        """This rank's position inside the group of `axis` (r for axis 0, c for axis 1)."""
        return self.r if axis == 0 else self.c

    def global_rank(self, axis: int, i: int) -> int:
        """Global rank of member i of this rank's group over `axis`."""
        base = self.dp_index * self.q * self.q
        return base + (i * self.q + self.c if axis == 0 else self.r * self.q + i)

    def __repr__(self) -> str:
        return f"Grid({self.q}x{self.q}, rank={self.rank}, (r, c)=({self.r}, {self.c}))"
