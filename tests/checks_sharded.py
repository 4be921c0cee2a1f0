"""Rank-side checks of sharded replicas (grid=(dp, R, C), data_parallel='shard': FSDP2 over the replicas).
Each returns plain data for the test to assert on."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import autopar
from autopar.parallel.sharded import memory_per_rank, program_for
from models import GPTConfig, TinyGPT
from tests.checks_engine import _data
from tests.checks_hf import build
from tests.compare import group_excess

STEPS = 3


def _models(family: str):
    """(model, batch(step, rows) -> (args, kwargs), loss_of(output))."""
    if family in ("tinygpt", "tinygpt-uneven"):
        torch.manual_seed(0)
        # uneven: a vocabulary of 97 and hidden 36 in 3 heads (torch.chunk blocks of unequal sizes on
        # the grid, then FSDP2's padding of each block's first dim)
        cfg = GPTConfig(layers=1) if family == "tinygpt" else GPTConfig(layers=1, vocab_size=97, hidden=36, heads=3)
        model = TinyGPT(cfg)

        def batch(step, rows):
            return _data(cfg, rows, 8, seed=step + 1), {}

        return model, batch, lambda out: out[1]
    torch.manual_seed(0)  # the same weights on every rank, as the reference of each
    if family == "mixtral":  # experts over the grid rows, their routed tokens dispatched
        import hf_families

        # no router loss: its load-balancing term over a batch is not the mean of its halves' terms, so
        # replicas (sharded or not) compute another loss than one process on the whole batch
        model, _ = hf_families.build("mixtral", output_router_logits=False)

        def make(b, s, seed):  # no padding: replicas with unequal token counts average unequal means
            ids = torch.randint(1, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))
            return dict(input_ids=ids, labels=ids)
    else:
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else {}
        model, make = build(family, **no_dropout)  # dropout draws other masks than one process's

    def batch(step, rows):
        return (), make(rows, 8, step + 1)

    return model, batch, lambda out: out.loss


def parity(rank, grid, family="tinygpt", rows=8, data_parallel="shard", **options):
    """`STEPS` AdamW steps of `family` on `grid` = (dp, R, C) with sharded replicas, each replica on its
    own rows of the global batch, against one process on the whole batch: the mean of the replicas'
    losses every step, every gradient after the first backward (gathered whole) and the clipped
    norm, and every parameter after the last step. Also: the bytes this rank holds between steps
    (parameters, gradients, AdamW states), what the replica axis moved against the plan, the
    explain line, and the placements of one weight."""
    model, batch, loss_of = _models(family)
    ref = copy.deepcopy(model)
    dp = grid[0]
    replica, mine = dist.get_rank() // (dist.get_world_size() // dp), rows // dp
    args, kwargs = batch(0, mine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=grid, example_inputs=args, example_kwargs=kwargs,
                                 data_parallel=data_parallel, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = autopar.plan(model, grid=grid, example_inputs=args, example_kwargs=kwargs, data_parallel=data_parallel,
                          **{k: v for k, v in options.items() if k != "compile"})
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    ref_params = dict(ref.named_parameters())
    # the plan prices grid position (0, 0) of replica 0: FSDP2's last replica holds a shorter (unpadded)
    # view of its padded shard where a block's first dim is not a multiple of dp
    out = {"losses": {}, "at (0, 0)": pm.grid.r == pm.grid.c == 0 and pm.grid.dp_index == 0,
           "plan": (pl.replicas.calls, pl.replicas.received_bytes, pl.replicas.param_bytes)}
    for step in range(STEPS):
        args, kwargs = batch(step, rows)
        sl = slice(mine * replica, mine * (replica + 1))
        my_args = tuple(a[sl] for a in args)
        my_kwargs = {k: v[sl] for k, v in kwargs.items()}
        pm.grid.log.reset()
        loss = loss_of(pm(*my_args, **my_kwargs))
        loss.backward()
        want = loss_of(ref(*args, **kwargs))
        want.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()  # every rank of a replica holds its replica's loss
        out["losses"].update(group_excess({f"loss step {step}": (mean, want.detach())}))
        if step == 0:
            out["grads"] = group_excess({n: (p.grad.full_tensor(), ref_params[n].grad)
                                         for n, p in pm.named_parameters()}, prefix="grad ")
            out["counted"] = (pm.grid.log.calls("fsdp:"), pm.grid.log.total("fsdp:"))
            t = pm.replica_traffic()  # None with data_parallel='replicate'
            out["planned"] = (t.calls, t.received) if t is not None else (0, 0)
            out["blocks"] = sum(1 for m in pm.modules() if isinstance(m, FSDPModule) and m is not pm)
            norm = pm.clip_grad_norm_(1e9)
            want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            out["norm"] = group_excess({"grad norm": (norm, want_norm)})
        opt.step()
        ref_opt.step()
        if step == 0:
            out["held"] = memory_per_rank(pm, opt)
        opt.zero_grad()
        ref_opt.zero_grad()
    out["params"] = group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()},
                                 prefix=f"param after {STEPS} steps ")
    out["total"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    out["line"] = [ln for ln in autopar.explain(pm).splitlines() if "replicas" in ln]
    name, p = next(iter(pm.named_parameters()))
    out["placements"] = (name, [str(x) for x in p.placements], p.device_mesh.mesh_dim_names)
    return out


def refusals(rank) -> dict:
    """What a user sees: data_parallel='shard' on a grid of one replica (a warning, nothing sharded), and
    FSDP2's fully_shard called on a ParallelModule by its caller (the next call raises, on every rank)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    args = _data(cfg, 4, 8)
    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=args, data_parallel="shard")
    out["warnings"] = [str(w.message) for w in seen if "data_parallel='shard'" in str(w.message)]
    out["unsharded"] = all(len(p.placements) == 2 for p in pm.parameters())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=args, reshard_after_forward=False)
    out["ignored"] = [str(w.message) for w in seen if "have no effect" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 1, 2), example_inputs=args)
        fully_shard(pm, mesh=pm.grid.full_mesh["dp"])
    try:
        pm(*args)
        out["foreign"] = "no error"
    except autopar.UsageError as e:
        out["foreign"] = str(e)
    return out


def _llama_step(pm, opt, step, rows=8):
    """One AdamW step of this rank's replica on its rows of the global batch; the replicas' mean loss."""
    _, batch, loss_of = _models("llama")
    dp = pm.grid.dp
    mine = rows // dp
    _, kwargs = batch(step, rows)
    sl = slice(mine * pm.grid.dp_index, mine * (pm.grid.dp_index + 1))
    loss = loss_of(pm(**{k: v[sl] for k, v in kwargs.items()}))
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean / dist.get_world_size())


def _llama(grid, data_parallel, seed=0):
    model, batch, _ = _models("llama")
    if seed:  # other initial values: a load must overwrite all of them
        torch.manual_seed(seed)
        for p in model.parameters():
            torch.nn.init.normal_(p)
    _, kwargs = batch(0, 8 // (grid[0] if len(grid) == 3 else 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=grid, example_kwargs=kwargs, data_parallel=data_parallel)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2), model


def checkpoints(rank, tmp) -> dict:
    """HF Llama at grid (2, 1, 2): DCP of sharded replicas and their AdamW state, resumed by a fresh
    sharded model (the same losses as the uninterrupted run), loaded at another grid with one replica
    and by replicated replicas (every parameter bit-equal to the saved), a replicated checkpoint loaded
    by sharded replicas, and save_pretrained's full tensors read by transformers on one process."""
    import os

    import transformers

    from autopar.checkpoint import load_distributed, save_distributed

    ck, hf, rep_ck = (os.path.join(tmp, n) for n in ("dcp", "hf", "dcp-replicated"))
    pm, opt, _ = _llama((2, 1, 2), "shard")
    for step in range(2):
        _llama_step(pm, opt, step)
    save_distributed(pm, ck, optimizer=opt)
    saved = {n: p.full_tensor() for n, p in pm.named_parameters()}
    autopar.save_pretrained(pm, hf)
    out = {"uninterrupted": [_llama_step(pm, opt, step) for step in (2, 3)]}
    pm2, opt2, _ = _llama((2, 1, 2), "shard", seed=5)
    load_distributed(pm2, ck, optimizer=opt2)
    out["resumed"] = [_llama_step(pm2, opt2, step) for step in (2, 3)]
    loaded = {}
    for grid, mode in (((2, 2), "replicate"), ((2, 1, 2), "replicate")):
        other, _, _ = _llama(grid, mode, seed=7)
        load_distributed(other, ck)
        loaded[f"{grid} {mode}"] = group_excess({n: (p.full_tensor(), saved[n]) for n, p in other.named_parameters()},
                                                rtol=0.0, frac=0.0)
        if mode == "replicate" and len(grid) == 3:
            save_distributed(other, rep_ck)
    back, _, _ = _llama((2, 1, 2), "shard", seed=9)
    load_distributed(back, rep_ck)
    loaded["replicated -> sharded"] = group_excess({n: (p.full_tensor(), saved[n]) for n, p in back.named_parameters()},
                                                   rtol=0.0, frac=0.0)
    out["loaded"] = loaded
    if rank == 0:
        one = transformers.LlamaForCausalLM.from_pretrained(hf)
        mine = dict(one.named_parameters())
        out["transformers"] = group_excess({n: (mine[n], t) for n, t in saved.items()}, rtol=0.0, frac=0.0)
    return out


def accumulation_and_generation(rank) -> dict:
    """HF Llama at grid (2, 1, 2), sharded: two micro-batches accumulated with FSDP2's
    set_requires_gradient_sync(False) on the first (one reduce-scatter per FSDP2 unit in all) against one process on
    both micro-batches' rows; then greedy generation against the unmodified model's."""
    pm, _, model = _llama((2, 1, 2), "shard")
    ref = copy.deepcopy(model)
    _, batch, loss_of = _models("llama")
    pm.grid.log.reset()
    for micro in range(2):
        _, kwargs = batch(micro, 8)
        sl = slice(4 * pm.grid.dp_index, 4 * (pm.grid.dp_index + 1))
        pm.set_requires_gradient_sync(micro == 1)
        (loss_of(pm(**{k: v[sl] for k, v in kwargs.items()})) / 2).backward()
        (loss_of(ref(**kwargs)) / 2).backward()
    ref_params = dict(ref.named_parameters())
    out = {"grads": group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                 prefix="grad "),
           "reduce-scatters": pm.grid.log.calls("fsdp:reduce-scatter"),
           "units": sum(1 for m in pm.modules() if isinstance(m, FSDPModule))}
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(3))  # checks_hf's vocabulary: 64
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    out["generated"] = (pm.generate(ids, **kw).tolist(), ref.generate(ids, **kw).tolist())
    # released after the call: a rank holds its 1/4 again (the gathered grid block would be 1/2)
    out["resharded"] = sum(p.to_local().numel() for p in pm.parameters()) <= 1.1 * sum(
        p.numel() for p in pm.parameters()) / 4
    return out


def loading(rank, tmp) -> dict:
    """Full tensors into sharded replicas (HF Llama at grid (2, 1, 2)): from_pretrained of a checkpoint
    transformers wrote on one process, and load_state_dict of a one-process state_dict; every parameter
    bit-equal to the model's."""
    import os

    _, _, model = _llama((2, 1, 2), "replicate")
    path = os.path.join(tmp, "one-process")
    if rank == 0:
        model.save_pretrained(path)
    dist.barrier()
    _, batch, _ = _models("llama")
    _, kwargs = batch(0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.from_pretrained(path, grid=(2, 1, 2), example_kwargs=kwargs, data_parallel="shard", progress=False)
    mine = dict(model.named_parameters())
    out = {"from_pretrained": group_excess({n: (p.full_tensor(), mine[n]) for n, p in pm.named_parameters()},
                                           rtol=0.0, frac=0.0),
           "sharded": all(len(p.placements) == 3 for p in pm.parameters())}
    other, _, _ = _llama((2, 1, 2), "shard", seed=11)
    other.load_state_dict(model.state_dict())
    out["load_state_dict"] = group_excess({n: (p.full_tensor(), mine[n]) for n, p in other.named_parameters()},
                                          rtol=0.0, frac=0.0)
    return out


def trainer(rank, tmp) -> dict:
    """ParallelTrainer (4 steps, AdamW, clipping) on HF Llama at grid (2, 1, 2), replicated and sharded:
    each one's losses and gradient norms, which must be the same run."""
    import os

    from autopar.hf.trainer import ParallelTrainer
    from tests import checks_trainer as T

    T._as_launched(rank)
    out = {}
    for mode in ("replicate", "shard"):
        pm, _, _ = _llama((2, 1, 2), mode)
        args = T.arguments(os.path.join(tmp, mode), save_strategy="no")
        run = ParallelTrainer(model=pm, args=args, train_dataset=T.Tokens())
        run.train()
        out[mode] = T._history(run)
    return out


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _ReadsABlockAfter(torch.nn.Module):
    """Two blocks; in eval mode, and on sequences longer than 8, the output also reads block 0's weight
    after the blocks, so those programs cannot run block 0 as one call of its FSDP2 unit."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(2)])
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        if not self.training or ids.shape[1] > 8:  # block 0's weight read outside block 0
            x = x + x @ self.layers[0].fc.weight.T
        return self.head(x)


def units_and_fallback(rank, **options) -> dict:
    """grid (2, 1, 2), sharded: a training step with each block an FSDP2 unit, an eval call whose
    program reads a block's weight outside the block (every unit gathered for it, the blocks released
    after),
    then another training step, then a training step on longer sequences whose program reads a block's
    weight outside it (every unit gathered, reduce-scattered and released by FSDP2 after backward);
    each against one process, with the parameters' shards held between."""
    torch.manual_seed(0)
    model = _ReadsABlockAfter()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    mine = ids[2 * (rank // 2):2 * (rank // 2) + 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=(2, 1, 2), example_inputs=(mine,), data_parallel="shard", **options)

    def blocks_held():  # the root stays gathered after a forward without grad (FSDP2's default for a root)
        return sum(p.to_local().numel() for n, p in pm.named_parameters() if n.startswith("layers."))

    shards = blocks_held()
    out: dict = {"units": sorted(n for n, m in pm.named_modules() if isinstance(m, FSDPModule) and n)}
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        pm.train()
        ref.train()
        pm.grid.log.reset()
        pm(mine).full_tensor().float().pow(2).mean().backward()
        if step == 0:
            t = pm.replica_traffic()
            out["counted"] = (pm.grid.log.calls("fsdp:"), pm.grid.log.total("fsdp:"))
            out["planned"] = (t.calls, t.received)
        (ref(ids).pow(2).mean()).backward()
        out.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                prefix=f"step {step} grad "))
        pm.zero_grad()
        ref.zero_grad()
        if step == 0:
            pm.eval()
            ref.eval()
            with torch.no_grad():
                out.update(group_excess({"eval output": (pm(mine).full_tensor(), ref(ids)[2 * (rank // 2):][:2])}))
            out["released after eval"] = blocks_held() == shards
            out["eval fetches"] = sorted(program_for(pm, pm.program)[1])  # none: every unit gathered for it
            first = next(iter(pm.programs.values()))  # the training program: each block's call fetches its own
            out["train fetches"] = sorted(program_for(pm, first)[1])
    longer = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))  # a training program
    pm.train()  # that gathers every unit: its gradients reduce-scattered at the end of backward
    ref.train()
    pm(longer[2 * (rank // 2):2 * (rank // 2) + 2]).full_tensor().float().pow(2).mean().backward()
    ref(longer).pow(2).mean().backward()
    out.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                            prefix="gathered training program grad "))
    out["released after gathered training"] = blocks_held() == shards
    out["longer fetches"] = sorted(program_for(pm, pm.program)[1])  # none: every unit gathered for it
    return out


class _SharedBlock(torch.nn.Module):
    """Three blocks, the second the first again (ALBERT-style sharing: one module under two names)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList([_Layer(), None, _Layer()])
        self.layers[1] = self.layers[0]
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def shared_block(rank, grid=(2, 1, 2)) -> dict:
    """Two steps of `_SharedBlock` on `grid` with sharded replicas, each replica on its rows, against one
    process on the whole batch: every gradient (the shared block's, summed over its two uses) and every
    parameter after the steps; the FSDP2 units."""
    torch.manual_seed(0)
    model = _SharedBlock()
    ref = copy.deepcopy(model)
    dp = grid[0]
    per = 4 // dp
    replica = dist.get_rank() // (dist.get_world_size() // dp)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=grid, example_inputs=(ids[:per],), data_parallel="shard")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, ref))
    ref_params = dict(ref.named_parameters())
    out: dict = {"units": sorted(n for n, m in pm.named_modules() if isinstance(m, FSDPModule) and n),
                 "names": sorted(n for n, _ in pm.named_parameters())}
    for step in range(2):
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step + 2))
        pm(ids[replica * per:(replica + 1) * per]).full_tensor().float().pow(2).mean().backward()
        ref(ids).pow(2).mean().backward()
        out.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                prefix=f"step {step} grad "))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out.update(group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()},
                            prefix="param after 2 steps "))
    return out
