"""Rank-side checks for training at scale: checkpoints, optimizer parity, mixed precision, dropout,
data parallelism. Each returns plain data for the test to assert on."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

import autopar
from models import GPTConfig, TinyGPT
from passes.compat import TorchDispatchMode, pytree
from passes.ops import grad_buckets
from tests.checks_engine import _data, _full
from tests.checks_hf import build
from tests.compare import excess, group_excess, scaled_atol


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (bytes) of a real (not fake, not meta) tensor any op returns while
    active, and what made it (`what`); views count as the storage they view. Byte tensors are left out:
    they are the pickled messages of the ranks' object collectives (2 KB for the options the ranks
    compare), not model data."""

    def __init__(self):
        super().__init__()
        self.largest, self.what = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and not t.is_meta and t.dtype != torch.uint8:
                if t.untyped_storage().nbytes() > self.largest:
                    self.largest, self.what = t.untyped_storage().nbytes(), (func, t.dtype, tuple(t.shape))
        return out


def _gpt2_batch(step, batch=4, seq=8):
    g = torch.Generator().manual_seed(step)
    return dict(input_ids=torch.randint(1, 64, (batch, seq), generator=g),
                labels=torch.randint(1, 64, (batch, seq), generator=g))


def hf_checkpoint_roundtrip(rank, tmp, family="gpt2"):
    """HF save_pretrained (index-sharded) -> autopar.from_pretrained (shard-on-read, meta init) ->
    one training step -> autopar.save_pretrained -> transformers from_pretrained."""

    torch.manual_seed(0)
    model, make = build(family)
    model.eval()
    src, out_dir = os.path.join(tmp, f"{family}_src"), os.path.join(tmp, f"{family}_out")
    if rank == 0:
        model.save_pretrained(src, max_shard_size="40KB")  # several files + index
    dist.barrier()
    res = {"index-sharded input": os.path.exists(os.path.join(src, "model.safetensors.index.json"))}
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    with LargestAllocation() as mode:
        pm = autopar.from_pretrained(src, grid=(2, 2), example_kwargs=make(4, 8, 0), progress=False)
    res["largest allocation / largest parameter"] = mode.largest / largest_param
    res["largest allocation"] = str(mode.what)
    pm.eval()
    kw = make(4, 8, 1)
    errs = group_excess({"load: loss": (_full(pm(**kw).loss), model(**kw).loss)})
    errs.update(group_excess({"load: logits": (pm(**kw).logits.full_tensor(), model(**kw).logits)}))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(**kw).loss.backward()
    opt.step()
    after_logits = pm(**make(4, 8, 2)).logits.full_tensor()
    autopar.save_pretrained(pm, out_dir, max_shard_bytes=30_000)
    dist.barrier()  # every rank reads the finished checkpoint back
    back = type(model).from_pretrained(out_dir)
    back.eval()
    errs.update(group_excess({"save: logits after a step": (back(**make(4, 8, 2)).logits, after_logits)}))
    res["excess"] = errs
    res["save: files"] = sorted(os.listdir(out_dir))
    return res


def _train(pm, opt, steps) -> list:
    """One AdamW step per GPT-2 batch in `steps`; the losses."""
    losses = []
    for step in steps:
        loss = pm(**_gpt2_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def dcp_save_resume(rank, tmp, q=2):
    """DCP save at 2x2 after 2 steps; a fresh model resumed from it follows the same loss trajectory."""
    ck = os.path.join(tmp, "dcp")

    def fresh():
        torch.manual_seed(0)
        m, _ = build("gpt2")
        m.eval()
        pm = autopar.parallelize(m, grid=(q, q), example_kwargs=_gpt2_batch(0))
        pm.eval()
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2)

    pm, opt = fresh()
    _train(pm, opt, range(2))
    msd, osd = get_state_dict(pm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    saved = {n: p.full_tensor() for n, p in pm.named_parameters()}
    if rank == 0:
        torch.save(saved, os.path.join(tmp, "saved_params.pt"))
    losses = _train(pm, opt, range(2, 5))
    pm2, opt2 = fresh()
    msd2, osd2 = get_state_dict(pm2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ck)
    set_state_dict(pm2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"losses": losses, "resumed": _train(pm2, opt2, range(2, 5))}


def dcp_load_other_grid(rank, tmp, q, strategy="2d"):
    """The 2x2 checkpoint loaded at another grid (q x q, or an (R, C) tuple) and strategy: every
    parameter equals the saved one."""
    torch.manual_seed(1)  # other initial values: the load must overwrite all of them
    m, _ = build("gpt2")
    grid = tuple(q) if isinstance(q, tuple) else (q, q)
    pm = autopar.parallelize(m, grid=grid, example_kwargs=_gpt2_batch(0), strategy=strategy)
    msd = get_model_state_dict(pm)
    dcp.load({"model": msd}, checkpoint_id=os.path.join(tmp, "dcp"))
    set_state_dict(pm, [], model_state_dict=msd, optim_state_dict={})
    saved = torch.load(os.path.join(tmp, "saved_params.pt"))
    return {n: excess(p.full_tensor(), saved[n], 0.0, 0.0) for n, p in pm.named_parameters()}  # bit equality


def train_parity(rank, steps=5, micro=2):
    """AdamW + clip_grad_norm_ + gradient accumulation over `micro` micro-batches, `steps` steps."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=_data(cfg, 4, 8))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)  # eps: see checks_engine.gpt_parity
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    errs = {}
    for step in range(steps):
        for k in range(micro):
            ids, tgt = _data(cfg, 4, 8, seed=10 * step + k)
            (pm(ids, tgt)[1] / micro).backward()
            (ref(ids, tgt)[1] / micro).backward()
        n = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        errs.update(group_excess({f"grad norm step {step}": (_full(n), rn)}))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    errs.update(group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()}, prefix="param "))
    return errs


def _err_vs_fp32(pairs) -> float:
    """Largest |bf16 - fp32| over a group, as a fraction of the group's largest fp32 value: one scale
    for a model's gradients, so a near-zero gradient's rounding does not read as a 100% error."""
    scale = scaled_atol([want for _, want in pairs.values()], 1.0)
    return max(excess(got.float(), want, 0.0, scale) for got, want in pairs.values())


def bf16(rank):
    """bf16 autocast and bf16 parameters: the error of the 2x2 model and of the single process, both
    against the fp32 single process (loss and gradients)."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    base = TinyGPT(cfg)
    ids, tgt = _data(cfg, 4, 8)
    fp32 = copy.deepcopy(base)
    fp32_loss = fp32(ids, tgt)[1]
    fp32_loss.backward()
    want = {n: p.grad for n, p in fp32.named_parameters()}
    out = {}
    for mode in ("autocast", "bf16 params"):
        model = copy.deepcopy(base)
        if mode == "bf16 params":
            model = model.bfloat16()
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(ids, tgt))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = pm(ids, tgt)[1]
            ref_loss = ref(ids, tgt)[1]
        loss.backward()
        ref_loss.backward()
        ref_params = dict(ref.named_parameters())
        out[mode] = {
            "loss": (_err_vs_fp32({"loss": (_full(loss), fp32_loss)}), _err_vs_fp32({"loss": (ref_loss, fp32_loss)})),
            "grad": (_err_vs_fp32({n: (p.grad.full_tensor(), want[n]) for n, p in pm.named_parameters()}),
                     _err_vs_fp32({n: (ref_params[n].grad, want[n]) for n in want})),
            "loss dtype": (str(loss.dtype), str(ref_loss.dtype)),
        }
    return out


def dropout_masks(rank):
    """In train mode each block draws its own mask; eval has none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
    x = torch.randn(8, 16)
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,))
    torch.manual_seed(123)  # every rank seeded alike, as training scripts do
    y = pm(x).full_tensor()
    zero = (y == 0)
    blocks = [zero[r * 4:(r + 1) * 4, c * 8:(c + 1) * 8] for r in range(2) for c in range(2)]
    same = sum(torch.equal(blocks[0], b) for b in blocks[1:])
    pm.eval()
    model.eval()
    return {"zero fraction": zero.float().mean().item(), "blocks equal to block 0": same,
            "eval parity": group_excess({"eval out": (pm(x).full_tensor(), model(x))})}


def dp_parity(rank, steps=2):
    """grid=(2, 2, 2): two data-parallel replicas of a 2x2 grid, each with its own half of the batch,
    against one process on the whole batch."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    replica = dist.get_rank() // 4
    pm = autopar.parallelize(model, grid=(2, 2, 2), example_inputs=_data(cfg, 4, 8))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    for step in range(steps):
        ids, tgt = _data(cfg, 8, 8, seed=step + 1)  # the global batch; replica i takes rows 4i..4i+3
        loss = pm(ids[4 * replica:4 * replica + 4], tgt[4 * replica:4 * replica + 4])[1]
        loss.backward()
        ref(ids, tgt)[1].backward()
        if step == 0:
            grads = group_excess({n: (p.grad.full_tensor(), dict(ref.named_parameters())[n].grad)
                                  for n, p in pm.named_parameters()}, prefix="grad ")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    params = group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()},
                          prefix=f"param after {steps} steps ")
    return {**grads, **params}


def dp_buckets(rank, grid=(2, 1, 2), bucket_mb=0.004, micro=2, compile=False):
    """`micro` micro-batches accumulated into .grad (forward and backward each) on `grid`, the replica
    gradients averaged in buckets of `bucket_mb` MiB: the gradients against one process on the whole
    batches, and the replica all-reduces counted against the bucket plan."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    d = grid[0]
    replica, rows = dist.get_rank() // (dist.get_world_size() // d), 8 // d
    pm = autopar.parallelize(model, grid=grid, example_inputs=_data(cfg, rows, 8), grad_bucket_mb=bucket_mb,
                             compile=compile)
    pm.grid.log.reset()
    launched, launch = [], grad_buckets.StepBuckets._launch

    def record(step, b, async_op):  # which buckets start during backward (async) and which at its end
        launched.append(async_op)
        launch(step, b, async_op)

    grad_buckets.StepBuckets._launch = record
    try:
        for m in range(micro):
            ids, tgt = _data(cfg, 8, 8, seed=m + 1)
            pm(ids[rows * replica:rows * (replica + 1)], tgt[rows * replica:rows * (replica + 1)])[1].backward()
            ref(ids, tgt)[1].backward()
    finally:
        grad_buckets.StepBuckets._launch = launch
    plan = pm.grad_bucket_plan()
    ref_params = dict(ref.named_parameters())
    return {"excess": group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                   prefix="grad "),
            "counted": (pm.grid.log.calls("dp:"), pm.grid.log.total("dp:")),
            "planned": (micro * len(plan.buckets), micro * plan.received(d)),
            "buckets": len(plan.buckets), "blocks": len(plan.keys), "async launches": sum(launched),
            "line": [ln for ln in autopar.explain(pm).splitlines() if "data-parallel" in ln]}


def meta_parallelize(rank):
    """A plain model built under meta_init: only blocks are allocated, and calling it before a load
    says what to do."""
    with autopar.meta_init():
        model = TinyGPT(GPTConfig(vocab_size=256, hidden=64))
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    with LargestAllocation() as mode:
        pm = autopar.parallelize(model, grid=(2, 2), example_inputs=_data(GPTConfig(vocab_size=256), 4, 8))
    try:
        pm(*_data(GPTConfig(vocab_size=256), 4, 8))
        msg = ""
    except RuntimeError as e:
        msg = str(e)
    return {"largest allocation / largest parameter": mode.largest / largest_param, "call error": msg}
