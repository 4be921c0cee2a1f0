"""Rank-side checks of `autopar.audit_devices` (run on every rank of a gloo pool by tests/test_device.py):
the paths that hand autopar's own tensors to collectives, each under the audit, and the findings."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

import autopar
from tests.checks_pipeline import _model


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def audited(rank, paths: tuple, tmp: str) -> dict:
    """Each path of `paths` run under the audit; per path the findings (as text). 'pipeline': 2 stages x 1x2
    of a Llama, a training step, an eval forward, clip_grad_norm_ and save_pretrained; 'replicas': (2, 1, 2)
    replicated and sharded, a training step and clip_grad_norm_ each; 'generate': 2x2, greedy; 'moe':
    Mixtral of 8 experts at 2x2, a training step; 'checks': a step whose input check fails (its verdict's
    collective)."""
    out: dict = {}
    for path in paths:
        with autopar.audit_devices() as audit:
            if path == "pipeline":
                model, make = _model("llama", 2)
                pm = _quiet(autopar.parallelize, model, grid=(1, 2), example_kwargs=make(4, 8, 1), pipeline=2)
                pm.train_step(**make(4, 8, 2))
                pm.clip_grad_norm_(1.0)
                pm.eval()
                with torch.no_grad():
                    pm(**make(4, 8, 3))
                autopar.save_pretrained(pm, os.path.join(tmp, "pipe"))
            elif path == "replicas":
                for mode in ("replicate", "shard"):
                    model, make = _model("llama", 2)
                    pm = _quiet(autopar.parallelize, model, grid=(2, 1, 2), example_kwargs=make(4, 8, 1),
                                data_parallel=mode)
                    pm(**make(4, 8, 2)).loss.backward()
                    pm.clip_grad_norm_(1.0)
            elif path == "generate":
                model, make = _model("llama", 2)
                pm = _quiet(autopar.parallelize, model, grid=(2, 2), example_kwargs=make(4, 8, 1))
                pm.generate(make(2, 6, 4)["input_ids"], max_new_tokens=3, do_sample=False)
            elif path == "moe":
                model, make = _model("mixtral", 2)
                pm = _quiet(autopar.parallelize, model, grid=(2, 2), example_kwargs=make(4, 8, 1))
                pm(**make(4, 8, 2)).loss.backward()
        out[path] = [str(f) for f in audit.findings]
    return out


def caught(rank, here: str) -> dict:
    """A tensor made without a device in code the audit watches (this folder, given as a root) and handed to
    an all-reduce is a finding naming both lines; one made on the device, or moved there, is not."""
    with autopar.audit_devices(roots=(here,)) as audit:
        host = torch.zeros(())  # no device: on a GPU node this is a CPU tensor
        dist.all_reduce(host + 1)  # computed from it: still on the host
        dist.all_reduce(torch.zeros((), device=torch.device("cpu")))  # made on the (model's) device
        dist.all_reduce(torch.zeros(2).to(torch.device("cpu")))  # moved there
    return {"findings": [str(f) for f in audit.findings]}
