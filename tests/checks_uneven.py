"""Rank-side checks for dims the grid does not divide (torch.chunk blocks): checkpoints keep the
model's true shapes and move between grids whose blocks differ."""

from __future__ import annotations

import os

import torch

import autopar
from autopar.checkpoint import hf as checkpoint
from tests.checks_hf import build
from tests.compare import excess

# a prime vocabulary (2x2: 49 + 48 rows; 1x4 columns: 25, 25, 25, 22) and 3 heads on 2 columns
GPT2_UNEVEN = dict(vocab_size=97, n_embd=24, n_head=3)


def _lm(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, 97, (b, s), generator=g), labels=torch.randint(0, 97, (b, s), generator=g))


def _gpt2(seed: int, grid, lowering: str = "broadcast"):
    torch.manual_seed(seed)
    model, _ = build("gpt2", **GPT2_UNEVEN)
    return model, autopar.parallelize(model, grid=grid, example_kwargs=_lm(4, 8, 0), lowering=lowering)


def _exact(pm, want: dict) -> dict:
    return {n: excess(p.full_tensor(), want[n], rtol=0.0, atol=0.0) for n, p in pm.named_parameters()}


def checkpoints_across_grids(rank, tmp):
    """Train one step at 2x2; state_dict shapes against the model's; save_distributed and
    save_pretrained; load the first at 1x4 and the second (from_pretrained) at 4x1, where every
    uneven dim has other blocks: parameters (and Adam states) bit-equal."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, pm = _gpt2(0, (2, 2))
    true_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(**_lm(4, 8, 1)).loss.backward()
    opt.step()
    opt.zero_grad()
    shapes = {k: tuple(v.shape) for k, v in pm.state_dict().items()}
    local_rows = tuple(pm.get_parameter("transformer.wte.weight").to_local().shape)
    want = {n: p.full_tensor() for n, p in pm.named_parameters()}
    want_opt = get_optimizer_state_dict(pm, opt)["state"]
    checkpoint.save_distributed(pm, os.path.join(tmp, "dcp"), optimizer=opt)
    autopar.save_pretrained(pm, os.path.join(tmp, "hf"))

    _, pm2 = _gpt2(1, (1, 4))
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=1e-2)
    pm2(**_lm(4, 8, 1)).loss.backward()
    opt2.step()  # Adam state the load must overwrite
    checkpoint.load_distributed(pm2, os.path.join(tmp, "dcp"), optimizer=opt2)
    errs = {f"dcp 1x4 {n}": e for n, e in _exact(pm2, want).items()}
    got_opt = get_optimizer_state_dict(pm2, opt2)["state"]
    for n, st in want_opt.items():
        for k in ("exp_avg", "exp_avg_sq"):
            errs[f"dcp 1x4 {n}.{k}"] = excess(got_opt[n][k].full_tensor(), st[k].full_tensor(), rtol=0.0, atol=0.0)

    pm3 = autopar.from_pretrained(os.path.join(tmp, "hf"), grid=(4, 1), example_kwargs=_lm(4, 8, 0), progress=False)
    errs.update({f"hf 4x1 {n}": e for n, e in _exact(pm3, want).items()})
    return {"errs": errs, "shapes": shapes, "true shapes": true_shapes, "wte block": local_rows}


def explain_text(rank):
    """explain of TinyGPT with a vocabulary of 97 and 3 heads on 2x2, on rank 0."""
    from models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, hidden=24, heads=3, layers=1)
    ids = torch.randint(0, 97, (4, 8))
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, ids))
    return autopar.explain(pm) if rank == 0 else ""


def planned_and_counted(rank, lowering="broadcast"):
    """One training step of GPT-2 (vocabulary 97, 3 heads of 8) at 2x2 with SUMMA `lowering`: for each
    inserted module, the bytes and calls (forward, backward) that the plan prices at this rank's grid
    position and that the rank counts, keyed by the module's log tag; and the modules' kinds."""
    from autopar.planning.explain import graph_rows
    from autopar.program.uneven import most_received

    _, pm = _gpt2(0, (2, 2), lowering)
    pm.grid.log.reset()
    pm(**_lm(4, 8, 1)).loss.backward()
    gm, log = pm.program.inspected, pm.grid.log
    rows = {r.node: r for r in graph_rows(gm, pm.grid.shape, at=(pm.grid.r, pm.grid.c))}
    out, kinds = {}, {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not hasattr(gm.get_submodule(node.target), "tag"):
            continue
        tag, r = gm.get_submodule(node.target).tag, rows[node.name]
        counted = tuple(log.bytes.get((tag, ph), 0) for ph in ("fwd", "bwd"))
        calls = tuple(log.launches.get((tag, ph), 0) for ph in ("fwd", "bwd"))
        out[tag] = {"planned": (r.fwd_bytes, r.bwd_bytes), "counted": counted,
                    "planned calls": (r.calls_fwd, r.calls_bwd), "counted calls": calls}
        kinds[tag] = type(gm.get_submodule(node.target)).__name__
    origin = sum(r.fwd_bytes + r.bwd_bytes for r in graph_rows(gm, pm.grid.shape))  # priced at (0, 0)
    return {"modules": out, "kinds": kinds, "at": (pm.grid.r, pm.grid.c), "total": log.total(),
            "most": most_received(gm, pm.grid.shape, origin)}
