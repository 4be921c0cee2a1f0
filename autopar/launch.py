"""Start q*q local processes with a gloo process group, for examples and tests on one machine."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """Join a local process group (one thread per process: 2-core machines run 4-9 ranks)."""
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world)


def close() -> None:
    """Leave the default group once every rank is done with it. Without the barrier a rank that
    finishes first tears down connections a peer is still using, and gloo aborts that peer ("terminate
    called without an active exception": `autopar calibrate` failed 3 runs in 8 that way)."""
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank, fn, world, port, args):
    init_local(rank, world, port)
    try:
        fn(rank, *args)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the peers may never reach it
        raise
    close()


def spawn(fn, world: int, *args) -> None:
    """Run fn(rank, *args) on `world` new processes joined in a gloo group; fn must be importable."""
    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)


def run(fn, world: int, backend: str = "gloo") -> None:
    """fn(rank) on every rank: under torchrun (RANK/WORLD_SIZE set) in this process, joining the group
    torchrun describes; otherwise on `world` local processes spawned here."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
        try:
            fn(dist.get_rank())
        except BaseException:
            dist.destroy_process_group()
            raise
        close()
    else:
        spawn(fn, world)
