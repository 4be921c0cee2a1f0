"""`parallelize(model, grid=p, strategy='auto')`: the search arranges the p ranks.

Global rank 0 runs `autopar.planning.grids.search_grids` over every R x C grid of p ranks and, where
p = q^3, the cube of 3D tensor parallelism (not replicas: every rank of the arrangement passes the same
batch, as on any grid), and sends the arrangement and its per-unit Choice to every rank, which
compile with it instead of searching again. A search error (nothing fits memory_limit) is raised on
every rank with rank 0's text.
"""

from __future__ import annotations

import torch.distributed as dist

from autopar.planning.grids import search_grids
from autopar.program.consensus import rebuilt
from autopar.program.guards import handshake
from passes.options import Options

__all__ = ["arrange"]


def arrange(model, devices: int, args: tuple, kwargs: dict | None, options: Options) -> tuple:
    """(grid, layout, Choice, table) for `devices` ranks: grid (R, C) with layout '2d', or (q, q, q) with
    layout '3d' (the cube, its units a mix of 3d and the other options); table, a row per candidate
    (`GridChoice.to_json`), which `autopar.explain` prints."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            picked = search_grids(model, devices, args, kwargs, options, replicas=False, who="autopar.parallelize")
            box[0] = ("ok", (picked.grid, picked.layout, picked.choice, picked.to_json()))
        except (MemoryError, ValueError) as e:  # raised on every rank below, with rank 0's text
            box[0] = ("error", type(e).__name__, str(e))
    with handshake("sending rank 0's choice of arrangement"):
        dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise rebuilt(box[0][1], box[0][2])
    return box[0][1]
