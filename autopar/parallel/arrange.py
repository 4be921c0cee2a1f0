"""`parallelize(model, grid=p, strategy='auto')`: the search arranges the p ranks.

Global rank 0 runs `autopar.planning.grids.search_grids` over every R x C grid of p ranks and, where
p = q^3, the cube of 3D tensor parallelism (not replicas: every rank of the arrangement passes the same
batch, as on any grid), and sends the arrangement and its per-unit Choice to every rank, which
compile with it instead of searching again (`autopar.program.consensus.decided_once`). A search error
(nothing fits memory_limit) is raised on every rank with rank 0's text.
"""

from __future__ import annotations

import torch.distributed as dist

from autopar.planning.grids import search_grids
from autopar.program.consensus import decided_once
from autopar.program.guards import handshake
from passes.options import Options

__all__ = ["arrange"]


def arrange(model, devices: int, args: tuple, kwargs: dict | None, options: Options) -> tuple:
    """(grid, layout, Choice, table) for `devices` ranks: grid (R, C) with layout '2d', or (q, q, q) with
    layout '3d' (the cube, its units a mix of 3d and the other options); table, a row per candidate
    (`GridChoice.to_json`), which `autopar.explain` prints."""
    def search():
        picked = search_grids(model, devices, args, kwargs, options, replicas=False, who="autopar.parallelize")
        return picked.grid, picked.layout, picked.choice, picked.to_json()

    return decided_once(search, dist.get_rank() == 0, lambda box: dist.broadcast_object_list(box, src=0),
                        handshake("sending rank 0's choice of arrangement"))
