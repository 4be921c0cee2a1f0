"""Rank-side checks for the guards of parallelize and of a call: options and grids that differ between
ranks, inputs that differ (reordered, or identical with NaN), bad arguments, full-tensor state_dicts,
clipping, and collectives bounded by `timeout=`."""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.nn as nn

import autopar
from models import GPTConfig, TinyGPT
from tests.checks_robust import _err
from tests.checks_engine import _data
from tests.compare import excess, scaled_atol

RTOL = 1e-4


class TwoBranches(nn.Module):
    """Computes two independent branches in an order given per process, as a model iterating over a
    set of strings does under hash randomization."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        outs = {name: torch.tanh(getattr(self, name)(x)).sum(-1) if name == "a" else torch.sigmoid(self.b(x)).mean(-1)
                for name in self.order}
        return outs["a"] + outs["b"]


def options_differ(rank):
    """One rank passes another lowering / check_inputs / grid: every rank raises the same UsageError."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    out = {}
    out["lowering"] = _err(lambda: autopar.parallelize(
        TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), lowering="allgather" if rank == 1 else "broadcast"))
    out["check_inputs"] = _err(lambda: autopar.parallelize(
        TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), check_inputs=rank == 2))
    out["grid"] = _err(lambda: autopar.parallelize(
        TinyGPT(cfg), grid=(1, 4) if rank == 3 else (2, 2), example_inputs=(ids, tgt)))
    out["bool grid"] = _err(lambda: autopar.parallelize(TinyGPT(cfg), grid=(True, 4), example_inputs=(ids, tgt)))
    torch.manual_seed(0)
    out["reordered"] = _err(lambda: autopar.parallelize(
        TwoBranches("ab" if rank % 2 == 0 else "ba"), grid=(2, 2), example_inputs=(torch.randn(4, 8),)))
    out["timeout"] = _err(lambda: autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), timeout=-1))
    return out


class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


def check_inputs_cases(rank):
    """Reordered token ids on one rank are caught; identical inputs holding NaN are not a false alarm;
    by default a rank's own batch is caught, and with check_inputs=False it is not."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), check_inputs=True)
    swapped = ids.clone()
    if rank == 2:  # the same multiset of ids (same sum and sum of squares), two positions swapped
        swapped[0, 0], swapped[0, 1] = ids[0, 1].item(), ids[0, 0].item()
    assert rank != 2 or not torch.equal(swapped, ids), "the test data must differ"
    out = {"swapped": _err(lambda: pm(swapped, tgt))}
    # a user coming from DDP: every rank draws its own batch, with the default options
    default = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt))
    out["own batch"] = _err(lambda: default(*_data(cfg, 4, 8, seed=100 + rank)))
    out["same batch"] = _err(lambda: default(*_data(cfg, 4, 8, seed=100)))
    off = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), check_inputs=False)
    out["own batch, off"] = _err(lambda: off(*_data(cfg, 4, 8, seed=100 + rank)))
    x = torch.randn(4, 8)
    x[1, 3] = float("nan")
    lin = autopar.parallelize(Features(), grid=(2, 2), example_inputs=(x,), check_inputs=True)
    out["nan identical"] = _err(lambda: lin(x))
    out["int to float model"] = _err(lambda: autopar.parallelize(
        Features(), grid=(2, 2), example_inputs=(torch.ones(4, 8, dtype=torch.long),)))
    out["int call"] = _err(lambda: lin(torch.ones(4, 8, dtype=torch.long)))
    return out


def state_dict_and_clip(rank):
    """A plain full state_dict loads into the parallel model (each rank keeps its blocks), and
    pm.clip_grad_norm_ equals torch.nn.utils.clip_grad_norm_ on one process (norm and clipped grads)."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt))
    torch.manual_seed(5)
    other = TinyGPT(cfg)  # different weights, loaded from plain tensors
    ref = copy.deepcopy(other)
    pm.load_state_dict(other.state_dict())
    params = dict(ref.named_parameters())
    errs = {f"loaded {n}": excess(p.full_tensor(), params[n], 0.0, 0.0) for n, p in pm.named_parameters()}
    out = {"wrong shape": _err(lambda: pm.load_state_dict({"tok.weight": torch.zeros(3, 3)}, strict=False))}
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (1.0, 1e6)):
        for m in (pm, ref):
            m.zero_grad()
        pm(ids, tgt)[1].backward()
        ref(ids, tgt)[1].backward()
        total = pm.clip_grad_norm_(max_norm, norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        errs[f"norm {norm_type}"] = excess(total, want, RTOL, 0.0)
        atol = scaled_atol(p.grad for p in ref.parameters())
        for n, p in pm.named_parameters():
            errs[f"clipped {norm_type} {n}"] = excess(p.grad.full_tensor(), params[n].grad, RTOL, atol)
    out["errs"] = errs
    return out


def clipping_is_quiet(rank):
    """Both clipping paths on a 2x2 grid: pm.clip_grad_norm_ and torch's function over the DTensor
    gradients. Returns each path's norm (as a float, for comparison across ranks), its distance to one
    process's norm, and the times DTensor asked to warn about sequential all-reduces."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(ids, tgt))
    ref(ids, tgt)[1].backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
    # DTensor warns once per process and mesh (a set of keys already warned about): count the calls,
    # so that a warning printed by an earlier check on this long-lived rank cannot hide one
    asked, original = [], _redistribute._warn_flatten_optimization_not_possible
    _redistribute._warn_flatten_optimization_not_possible = lambda *a, **k: asked.append(a[-1])
    out = {}
    try:
        for name, clip in (("pm", lambda: pm.clip_grad_norm_(1e6)),
                           ("torch", lambda: torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e6))):
            pm.zero_grad()
            pm(ids, tgt)[1].backward()
            total = clip()
            total = total.full_tensor() if isinstance(total, DTensor) else total
            out[name] = (float(total), excess(total, want, RTOL, 0.0))
    finally:
        _redistribute._warn_flatten_optimization_not_possible = original
    out["dtensor warnings"] = asked
    return out


def skipped_collective(rank, world, port, outdir, what):
    """Run as a fresh process group with timeout=5: rank 3 stays alive but skips the call; the others
    must raise within the timeout instead of the process group's 30 minutes."""
    from autopar.launch import init_local

    init_local(rank, world, port)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    torch.distributed.barrier()  # start together: groups built with timeout=5 also connect within 5 s
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), timeout=5,
                             check_inputs=what == "check_inputs")
    if what != "check_inputs":
        pm(ids, tgt)[1].backward()
    if rank == 3:
        time.sleep(40)
        os._exit(0)
    start = time.time()
    if what == "check_inputs":
        kind, msg = _err(lambda: pm(ids, tgt))
    elif what == "clip":
        kind, msg = _err(lambda: pm.clip_grad_norm_(1.0))
    else:  # torch's own clipping over DTensor gradients: DTensor's collectives on the mesh's groups
        kind, msg = _err(lambda: torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0))
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{time.time() - start:.1f}\n{msg}")
    os._exit(0)


def replicas_with_timeout(rank):
    """grid=(2, 1, 2) with timeout= (every group built bounded) and check_inputs: the replicas' averaged
    gradients and pm.clip_grad_norm_ equal one process on the whole batch."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=(2, 1, 2), example_inputs=_data(cfg, 4, 8), timeout=60, check_inputs=True)
    ids, tgt = _data(cfg, 8, 8, seed=3)
    replica = rank // 2
    pm(ids[4 * replica:4 * replica + 4], tgt[4 * replica:4 * replica + 4])[1].backward()
    ref(ids, tgt)[1].backward()
    total = pm.clip_grad_norm_(0.1)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    params = dict(ref.named_parameters())
    atol = scaled_atol(p.grad for p in ref.parameters())
    errs = {"norm": excess(total, want, RTOL, 0.0)}
    errs.update({n: excess(p.grad.full_tensor(), params[n].grad, RTOL, atol) for n, p in pm.named_parameters()})
    return errs


def host_syncs(rank):
    """Host syncs per step of a 2x2 TinyGPT (forward with its loss, backward), counted as
    `autopar.count_host_syncs` counts them, with checks='now' and 'late'; and the errors a late check
    raises at the next call (an id outside the table, a target outside the vocabulary, a rank's own batch)."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    out = {}
    for checks in ("now", "late"):
        pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), checks=checks)
        counts = []
        for _ in range(2):
            with autopar.count_host_syncs() as syncs:
                pm(ids, tgt)[1].backward()
            counts.append((syncs.total, dict(syncs.sites)))
        out[checks] = counts
    bad_id, bad_tgt = ids.clone(), tgt.clone()
    bad_id[1, 2] = cfg.vocab_size + 3
    bad_tgt[2, 5] = -7
    out["late id"] = (_err(lambda: pm(bad_id, tgt)), _err(lambda: pm(ids, tgt)), _err(lambda: pm(ids, tgt)))
    out["late target"] = (_err(lambda: pm(ids, bad_tgt)), _err(autopar.flush_checks))
    own = _data(cfg, 4, 8, seed=100 + rank)
    out["late own batch"] = (_err(lambda: pm(*own)), _err(lambda: pm(ids, tgt)))
    return out


def skips_one_broadcast(rank, world, port, outdir, timeout=3):
    """Run as a fresh process group with `timeout`: after one good step, rank 3 skips the third SUMMA
    broadcast of its second step's forward (as a rank whose program took another branch would), then every
    rank goes on stepping. Each rank writes when the bad step began (start<rank>.txt), then the error it got,
    how long after the bad step began, and the error's text (rank<rank>.txt)."""
    from autopar.launch import init_local
    from passes.ops import comm

    init_local(rank, world, port)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    torch.distributed.barrier()  # start together: groups built with timeout=3 also connect within 3 s
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), timeout=timeout,
                             lowering="broadcast")
    pm(ids, tgt)[1].backward()
    if rank == 3:
        real, seen = comm.broadcast, []

        def skipping(*args, **kwargs):
            seen.append(1)
            return None if len(seen) == 3 else real(*args, **kwargs)  # None: nothing to wait for

        comm.broadcast = skipping
    start = time.time()
    with open(os.path.join(outdir, f"start{rank}.txt"), "w") as f:
        f.write(f"{start}")

    def steps():
        for _ in range(4):
            pm(ids, tgt)[1].backward()

    kind, msg = _err(steps)
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{time.time() - start:.1f}\n{msg}")
    time.sleep(3)  # rank 0 hosts the store here: it stays up for the slower ranks' reports, as torchrun's does
    os._exit(0)
