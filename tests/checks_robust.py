"""Rank-side checks for failure behaviour: bad input, ranks that disagree, dying ranks, interrupted
saves, and the randomized parity sweep's model builder."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import autopar
from models import GPTConfig, TinyGPT
from tests.checks_engine import _data, _full
from tests.compare import group_excess


def _err(fn):
    try:
        fn()
    except Exception as e:  # the test asserts on the type name and the text
        return type(e).__name__, str(e)
    return None, ""


class CumprodModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumprod(self.lin(x), dim=-1)  # no rule: would be gathered whole


def bad_inputs(rank):
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    out = {}
    out["zero grid"] = _err(lambda: autopar.parallelize(TinyGPT(cfg), grid=(0, 0), example_inputs=(ids, tgt)))
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt))
    out["structure"] = _err(lambda: pm(ids))
    out["device"] = _err(lambda: pm(ids.to("meta"), tgt.to("meta")))
    lin = autopar.parallelize(nn.Linear(8, 8), grid=(2, 2), example_inputs=(torch.randn(4, 8),))
    out["dtype"] = _err(lambda: lin(torch.randn(4, 8, dtype=torch.float64)))
    out["strict unsupported"] = _err(lambda: autopar.parallelize(
        CumprodModel(), grid=(2, 2), example_inputs=(torch.randn(4, 8),), on_unsupported="error"))
    mine = _data(cfg, 8 if rank == 1 else 4, 8)  # rank 1 passes another batch size
    out["plans differ"] = _err(lambda: autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=mine))
    checked = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), check_inputs=True)
    other = _data(cfg, 4, 8, seed=1 + (rank == 2))  # rank 2 passes other token ids of the same shape
    out["inputs differ"] = _err(lambda: checked(*other))
    torch.manual_seed(7)
    state = TinyGPT(cfg).state_dict()
    if rank == 3:
        state["blocks.0.mlp.up.weight"] = state["blocks.0.mlp.up.weight"] + 1e-3  # one rank's dict differs
    out["state differs"] = _err(lambda: pm.load_state_dict(state))
    out["batch differs"] = _err(lambda: pm(*_data(cfg, 8 if rank == 1 else 4, 8)))
    out["after batch differs"] = _err(lambda: pm(ids, tgt))
    other_vocab = TinyGPT(GPTConfig(vocab_size=66 if rank == 1 else 64))  # ids < 64 fit both
    out["model differs"] = _err(lambda: autopar.parallelize(other_vocab, grid=(2, 2), example_inputs=(ids, tgt)))
    wide = nn.Sequential(nn.Linear(8, 64 if rank == 2 else 32), nn.ReLU(), nn.Linear(64 if rank == 2 else 32, 8))
    out["mlp differs"] = _err(lambda: autopar.parallelize(wide, grid=(2, 2), example_inputs=(torch.randn(4, 8),)))
    out["nested"] = _err(lambda: autopar.parallelize(pm, grid=(2, 2), example_inputs=(ids, tgt)))
    out["nested inside"] = _err(lambda: autopar.parallelize(nn.Sequential(pm), grid=(2, 2),
                                                            example_inputs=(ids, tgt)))
    return out


def dying_rank(rank, world, port, outdir):
    """Run as a fresh process group: rank 3 exits before the step; the others must raise."""
    from autopar.launch import init_local

    init_local(rank, world, port)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, tgt), timeout=20)
    if rank == 3:
        os._exit(3)
    kind, msg = _err(lambda: pm(ids, tgt)[1].backward())
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{msg}")
    os._exit(0)


def interrupted_save(rank, world, port, outdir):
    """A save killed after its first shard leaves the previous checkpoint loadable."""
    from autopar.checkpoint import save as checkpoint
    from autopar.launch import init_local
    from tests.checks_hf import build

    init_local(rank, world, port)
    torch.manual_seed(0)
    model, make = build("gpt2")
    pm = autopar.parallelize(model, grid=(1, 1), example_kwargs=make(4, 8, 0))
    path = os.path.join(outdir, "ckpt")
    autopar.save_pretrained(pm, path, max_shard_bytes=20_000)  # the good checkpoint
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().add_(1.0)  # a different model, whose save is interrupted
    real_write = checkpoint.write
    calls = []

    def dying_write(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os._exit(9)  # killed mid-save, after one new shard is on disk
        real_write(*a, **k)

    checkpoint.write = dying_write
    autopar.save_pretrained(pm, path, max_shard_bytes=20_000)
    os._exit(0)  # not reached


# --- the randomized sweep: a small model from a spec, parity on one grid --------------------------

class SweepBlock(nn.Module):
    def __init__(self, spec):
        super().__init__()
        h, heads = spec["hidden"], spec["heads"]
        self.spec = spec
        self.norm = nn.LayerNorm(h) if spec["norm"] == "layer" else nn.RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=spec["bias"]) if spec["fused"] else None
        if not spec["fused"]:
            self.q, self.k, self.v = (nn.Linear(h, h, bias=spec["bias"]) for _ in range(3))
        self.o = nn.Linear(h, h, bias=spec["bias"])
        self.up = nn.Linear(h, spec["ffn"], bias=spec["bias"])
        self.down = nn.Linear(spec["ffn"], h, bias=spec["bias"])
        self.heads = heads

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm(x)
        if self.qkv is not None:
            q, k, v = self.qkv(y).split(h, dim=-1)
        else:
            q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.spec["attn"] == "sdpa":
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # written out: matmul, scale, softmax, matmul
            w = (q @ k.transpose(-1, -2)) * (h // self.heads) ** -0.5
            a = torch.softmax(w, dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        act = {"gelu": nn.functional.gelu, "silu": nn.functional.silu, "tanh": torch.tanh}[self.spec["act"]]
        return x + self.down(act(self.up(x)))


class SweepModel(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.inp = nn.Linear(spec["features"], spec["hidden"])
        self.blocks = nn.ModuleList(SweepBlock(spec) for _ in range(spec["layers"]))
        self.out = nn.Linear(spec["hidden"], spec["classes"])

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.out(x).mean(dim=1)  # [b, classes]


def sweep_case(rank, spec):
    """Outputs and every gradient of a spec'd model on the pool's grid against one process."""
    import copy

    q = int(round(torch.distributed.get_world_size() ** 0.5))
    grid = tuple(spec.get("grid", (q, q)))
    options = {"strategy": spec.get("strategy", "2d")}
    if "cost" in spec:  # (alpha, beta, flops) of both mesh axes: steers strategy='auto' to varied plans
        a, b, f = spec["cost"]
        axis = {"alpha_s": a, "beta_bytes_per_s": b, "points": []}
        options["cost_model"] = {"version": 1, "source": "sweep", "grid": list(grid), "backend": "gloo",
                                 "device": "cpu", "axes": [axis, axis], "flops_per_s": f, "when": "sweep"}
    torch.manual_seed(spec["seed"])
    model = SweepModel(spec)
    ref = copy.deepcopy(model)
    x = torch.randn(spec["batch"], spec["seq"], spec["features"], generator=torch.Generator().manual_seed(7))
    pm = autopar.parallelize(model, grid=grid, example_inputs=(x,), **options)
    out = _full(pm(x))
    want = ref(x)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()  # a loss that weighs every output
    (want * torch.arange(want.numel()).view_as(want)).sum().backward()
    ref_params = dict(ref.named_parameters())
    errs = group_excess({"out": (out, want)})
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             prefix="grad "))
    return errs


def out_of_range(rank):
    """Ids, positions and targets outside their tables, at 2x2: what one process does (the unmodified
    model, which raises IndexError) and what every rank of the parallel model does; a bad target sits
    in the first batch row only, which one mesh row holds. Then HF Llama's ids and labels."""
    import transformers as T

    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    model = TinyGPT(cfg)
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(ids, tgt))

    def edit(t, value, row=0, col=3):
        t = t.clone()
        t[row, col] = value
        return t

    long_ids, long_tgt = _data(cfg, 4, cfg.max_seq + 4)  # positions past the 16-row position table
    cases = {
        "id = vocab": (edit(ids, cfg.vocab_size, row=2), tgt),
        "id = -1": (edit(ids, -1), tgt),
        "sequence > positions": (long_ids, long_tgt),
        "target = vocab": (ids, edit(tgt, cfg.vocab_size + 5)),
        "target = -1": (ids, edit(tgt, -1)),
    }
    out = {}
    for name, args in cases.items():
        out[name] = (_err(lambda a=args: model(*a)), _err(lambda a=args: pm(*a)))
    ignored = edit(tgt, -100)  # ignore_index: a valid target, the loss leaves it out
    out["ignore_index"] = (model(ids, ignored)[1].item(), pm(ids, ignored)[1].item())
    out["after errors"] = (model(ids, tgt)[1].item(), pm(ids, tgt)[1].item())  # nothing left out of step

    tcfg = T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(tcfg)
    hids = torch.randint(0, 96, (4, 6), generator=torch.Generator().manual_seed(3))
    pl = autopar.parallelize(llama, grid=(2, 2), example_kwargs=dict(input_ids=hids, labels=hids))
    for name, kw in {"llama id = vocab": dict(input_ids=edit(hids, 96, row=3, col=1), labels=hids),
                     "llama label = vocab": dict(input_ids=hids, labels=edit(hids, 200, row=1, col=4))}.items():
        out[name] = (_err(lambda k=kw: llama(**k)), _err(lambda k=kw: pl(**k)))
    # parallelized with labels=input_ids (one tensor in both places, as HF examples pass them): export
    # read the embedding's ids from `labels`, so a call with padded labels embedded -100s
    masked = hids.clone()
    masked[:, :2] = -100
    out["example labels is input_ids"] = (llama(input_ids=hids, labels=masked).loss.item(),
                                          pl(input_ids=hids, labels=masked).loss.item())
    return out


def stalled_fsdp_peer(rank, world, port, outdir):
    """Run as a fresh process group of 2: sharded replicas on grid (2, 1, 1) with timeout=5; rank 1 stops
    calling the model (sleeps past the timeout) while rank 0 steps, whose FSDP2 all-gather must end in
    a CollectiveError after about 5 s."""
    import time

    from autopar.launch import init_local

    init_local(rank, world, port)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids, tgt = _data(cfg, 4, 8)
    pm = autopar.parallelize(TinyGPT(cfg), grid=(2, 1, 1), example_inputs=(ids[:2], tgt[:2]), timeout=5,
                             data_parallel="shard")
    if rank == 1:
        time.sleep(12)
        os._exit(0)
    start = time.monotonic()
    kind, msg = _err(lambda: pm(ids[:2], tgt[:2])[1].backward())
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{kind}\n{time.monotonic() - start:.1f}\n{msg}")
    os._exit(0)
