"""The device rules of a parallelized model (autopar.program.device), checked on one process: the device
comes from the parameters, not the example inputs; NCCL gets only CUDA models on the current device."""

import pytest
import torch

from autopar.errors import UsageError
from autopar.program.device import check_backend, model_device


def test_the_device_is_the_parameters():
    """The mesh used to take the example inputs' device: CPU example inputs with a CUDA model built a
    CPU mesh and moved the parameters to the CPU. Now the parameters decide; inputs elsewhere are refused."""
    lin = torch.nn.Linear(4, 4)
    assert model_device(lin, (torch.ones(2, 4),), {}) == torch.device("cpu")
    with pytest.raises(UsageError, match=r"example inputs are on meta but the model's parameters on cpu: pass the "
                                         r"example inputs \(and every later call's\) on cpu"):
        model_device(lin, (torch.ones(2, 4, device="meta"),), {})
    # a model built on the meta device (to be loaded) runs where its inputs are
    meta = torch.nn.Linear(4, 4, device="meta")
    assert model_device(meta, (), {"x": torch.ones(2, 4)}) == torch.device("cpu")
    assert model_device(torch.nn.ReLU(), (), {}) == torch.device("cpu")


@pytest.mark.parametrize("device, backend, current, local_rank, gpus, message", [
    ("cpu", "nccl", None, None, 0, r"uses NCCL, which moves CUDA tensors only, but this rank's model is on cpu"),
    ("cuda:1", "nccl", 0, None, 8, r"model is on cuda:1 but the current CUDA device is cuda:0.*"
                                   r"torch.cuda.set_device\(1\)"),
    ("cuda:0", "nccl", 0, "3", 8, r"LOCAL_RANK is 3 but this rank's current CUDA device is cuda:0.*Duplicate GPU"),
])
def test_nccl_refuses_what_it_cannot_move(device, backend, current, local_rank, gpus, message):
    """Each of these hung or failed inside NCCL with a message naming none of it (the object collectives
    parallelize opens with are staged on the current device)."""
    with pytest.raises(UsageError, match=message):
        check_backend(torch.device(device), backend, current, local_rank, gpus)


@pytest.mark.parametrize("device, backend, current, local_rank, gpus", [
    ("cpu", "gloo", None, None, 0), ("cpu", "cpu:gloo,cuda:nccl", None, None, 0), ("cuda:3", "nccl", 3, "3", 8),
    ("cuda:0", "nccl", 0, "5", 4),  # LOCAL_RANK past the node's GPUs: a launcher's own numbering, not ours to judge
])
def test_what_nccl_and_gloo_can_move_passes(device, backend, current, local_rank, gpus):
    check_backend(torch.device(device), backend, current, local_rank, gpus)


def test_the_audit_finds_a_host_tensor_in_a_collective(pool4):
    """`autopar.audit_devices` without a GPU: a tensor made without a device, and what is computed from it,
    handed to an all-reduce is named with the line that made it and the line that issued the call; tensors
    made on the device or moved there are not (every rank)."""
    import os

    from tests.checks_audit import caught

    for rank, r in enumerate(pool4.run(caught, os.path.dirname(os.path.abspath(__file__)))):
        assert len(r["findings"]) == 1, (rank, r)
        assert r["findings"][0].startswith("allreduce of a [] torch.float32 tensor made on the host at "
                                           "checks_audit.py:"), (rank, r)
        assert "issued at checks_audit.py:" in r["findings"][0], (rank, r)


@pytest.mark.parametrize("paths", [
    ("pipeline",),  # the loss broadcast of the stages without a loss, the stages' sends, clip, save_pretrained
    ("replicas", "generate", "moe"),
])
def test_autopar_hands_collectives_no_host_tensor(pool4, tmp_path, paths):
    """Catches a tensor autopar makes on the host for a collective, which NCCL refuses on a GPU node (the
    pipeline's loss broadcast did: `torch.zeros(())`): pipeline training, evaluation, clipping and saving;
    replicated and sharded replicas; generation; a mixture of experts, every rank under the audit."""
    from tests.checks_audit import audited

    if "pipeline" in paths and _torch_below(2, 13):  # pipelines refuse it (test_pipelines_need_torch_2_13)
        paths = ("replicas",)
    for rank, r in enumerate(pool4.run(audited, paths, str(tmp_path))):
        assert r == {p: [] for p in paths}, (rank, r)


def _torch_below(major: int, minor: int) -> bool:
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (major, minor)


def test_pipelines_need_torch_2_13(monkeypatch):
    """torch 2.11's PipelineStage asks for the gradient of every boundary tensor, integer masks included, and
    failed inside the first step (make test-compat, Dec 2026): refused up front, naming the version."""
    from autopar.errors import TorchVersionError
    from autopar.parallel.pipeline import pipeline_parallelize
    from autopar.program.spec import parse_spec

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(TorchVersionError, match=r"pipelines need torch >= 2.13 \(this is 2.11.0\+cu130\)"):
        pipeline_parallelize(None, parse_spec((1, 2), pipeline=2), (), None, None, torch.device("cpu"), None)
