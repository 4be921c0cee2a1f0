"""The device a parallelized model lives on, and whether the process group can reach it.

The device is the parameters' (`model.to(device)` before `parallelize`); a model on the meta device, built
to be loaded later, takes its example inputs' (where its blocks will be allocated). Example inputs on
another device than the parameters are refused, as one process refuses them at the first matmul. The
grid's mesh, the shards and every tensor handed to a collective live there.

NCCL moves CUDA tensors only, from the device current on each rank: a CPU model under NCCL, a model on
cuda:1 while the current device is cuda:0, or every rank left on cuda:0 by a launcher that starts one
process per GPU (LOCAL_RANK set) and a script that never called `torch.cuda.set_device` hang or fail
inside NCCL with a message that names none of this. `check_backend` refuses each up front.

>>> import torch
>>> model_device(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {})
device(type='cpu')
>>> model_device(torch.nn.Linear(2, 2, device="meta"), (torch.ones(1, 2),), {})
device(type='cpu')
>>> try:
...     check_backend(torch.device("cpu"), "nccl", None, None)
... except UsageError as e:
...     print(str(e)[:71])
the default process group uses NCCL, which moves CUDA tensors only, but
"""

from __future__ import annotations

import os

import torch

from autopar.errors import UsageError
from passes.compat import pytree

__all__ = ["check_backend", "check_device", "model_device"]


def model_device(model: torch.nn.Module, args, kwargs) -> torch.device:
    """The device `model` is parallelized on: its parameters' (one device), else (parameters on the meta
    device, or none) the first tensor input's, else the CPU. Raises UsageError for parameters on several
    devices, or example inputs on another device than the parameters."""
    inputs = next((t.device for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)), None)
    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return inputs or torch.device("cpu")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise UsageError(f"the model's parameters are on several devices ({', '.join(devices)}): move the whole model "
                         f"to this rank's device first (model.to(device)); autopar then splits it over the grid")
    device = params[0].device
    if inputs is not None and inputs != device:
        raise UsageError(f"the example inputs are on {inputs} but the model's parameters on {device}: pass the example "
                         f"inputs (and every later call's) on {device}, as one process needs them there")
    return device


def check_backend(device: torch.device, backend: str | None, current: int | None, local_rank: str | None,
                  gpus: int = 0) -> None:
    """Refuse a `device` the default process group (`backend`, e.g. 'nccl', 'gloo', 'cpu:gloo,cuda:nccl')
    cannot move tensors of: NCCL and a non-CUDA model; a CUDA model off the `current` CUDA device; a
    current device other than LOCAL_RANK's (`local_rank`, where a launcher set it) when the node has
    that many (`gpus`)."""
    if backend is None:
        return
    if device.type != "cuda":
        if backend == "nccl":
            raise UsageError(
                f"the default process group uses NCCL, which moves CUDA tensors only, but this rank's model is on "
                f"{device}: move it to this rank's GPU first (torch.cuda.set_device(local_rank); "
                f"model.to(local_rank)), or use backend='gloo' for a model on the CPU")
        return
    if current is not None and device.index is not None and device.index != current:
        raise UsageError(
            f"this rank's model is on {device} but the current CUDA device is cuda:{current}, which NCCL and "
            f"autopar's collectives use: call torch.cuda.set_device({device.index}) (torch.cuda.set_device(local_rank) "
            f"before init_process_group) so that each rank's model and collectives share its GPU")
    if local_rank is not None and local_rank.isdigit() and current is not None and current != int(local_rank) \
            and int(local_rank) < gpus:
        raise UsageError(
            f"LOCAL_RANK is {local_rank} but this rank's current CUDA device is cuda:{current}: every process of "
            f"this node would use cuda:{current} (NCCL: 'Duplicate GPU detected', or a hang). Call "
            f"torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) first thing in each process, then build or move "
            f"the model there")


def check_device(device: torch.device) -> None:
    """`check_backend` for this process: the default group's backend, the current CUDA device, LOCAL_RANK."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else None
    if backend == "fake":  # a dry run: no device to reach
        return
    current = torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available() else None
    gpus = torch.cuda.device_count() if current is not None else 0
    check_backend(device, backend, current, os.environ.get("LOCAL_RANK"), gpus)
