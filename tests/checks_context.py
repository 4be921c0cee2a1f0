"""Rank-side checks of context parallelism (`parallelize(..., context_parallel=cp)`), run by tests/test_context.py."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import UsageError
from examples.models import GPTConfig, TinyGPT
from passes.cost.context import alltoall_bytes, attention_bytes, loss_bytes, output_bytes, ring_bytes, step_bytes
from passes.cost.context import flavour
from passes.ops.context import ContextAttention
from tests.compare import group_excess

VOCAB = 96


def _hf(family: str, **extra):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, use_cache=False)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **common))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, **{
            "sliding_window": None, **common, **extra}))
    if family == "neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    raise ValueError(family)


class Encoder(nn.Module):
    """Unmasked (bidirectional) attention and a per-token regression head: no causal mask, no loss in forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.inp(x)
        q, k, v = self.qkv(h).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 32)
        return self.out(h + y)


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt":
        return TinyGPT(GPTConfig(vocab_size=VOCAB, max_seq=32, hidden=32, heads=4, layers=2))
    if family == "encoder":
        return Encoder()
    return _hf(family)


def _batch(family: str, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if family == "encoder":
        return (torch.randn(batch, seq, 8, generator=g),), {}
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g) if family == "gpt" else ids.clone()
    labels[1, -5:] = -100  # a padded row: its last tokens count no target (two chunks at cp 4, seq 16)
    return ((ids, labels), {}) if family == "gpt" else ((), dict(input_ids=ids, labels=labels))


def _out(family: str, out):
    """(per-token output, loss or None) of a call."""
    if family == "gpt":
        return out
    if family == "encoder":
        return out, None
    return out.logits, out.loss


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rows(args, kwargs, b: int, dp: int):
    """Data-parallel batch b of dp: its rows of every input."""
    def cut(t):
        n = t.shape[0] // dp
        return t[b * n:(b + 1) * n]
    return tuple(cut(t) for t in args), {k: cut(t) for k, t in kwargs.items()}


def parity(rank, family: str, grid: tuple, cp: int, seq: int = 16, batch: int = 4, steps: int = 2,
           expect_recompute: bool = False, **options):
    """Outputs, loss, every gradient (step 0), the loss of every step and the parameters after `steps` AdamW
    steps against the unmodified model on one process; the context-parallel bytes of step 0 as counted and as
    `passes.cost.context` prices them. With grid=(dp, R, C), dp batches of batch/dp rows each, every batch's cp
    ranks passing theirs: against one process whose loss is the mean of the dp batches' losses (data parallel)."""
    torch.set_num_threads(1)
    model = _model(family)
    ref = copy.deepcopy(model)
    dp = grid[0] if len(grid) == 3 else 1
    args, kwargs = _batch(family, batch, seq, 1)
    pm = autopar.parallelize(model, grid=grid, example_inputs=_rows(args, kwargs, 0, dp)[0],
                             example_kwargs=_rows(args, kwargs, 0, dp)[1] or None, context_parallel=cp, **options)
    mine = pm.grid.batch_index
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    ref_params = dict(ref.named_parameters())
    errs, counted = {}, {}
    for step in range(steps):
        args, kwargs = _batch(family, batch, seq, step + 1)
        pm.grid.log.reset()
        y, loss = _out(family, pm(*_rows(args, kwargs, mine, dp)[0], **_rows(args, kwargs, mine, dp)[1]))
        refs = [_out(family, ref(*a, **k)) for a, k in (_rows(args, kwargs, b, dp) for b in range(dp))]
        ry = refs[mine][0]
        if loss is None:  # the user's loss on the gathered output
            loss, refs = (_whole(y) ** 2).mean(), [(o, (o ** 2).mean()) for o, _ in refs]
        rloss = sum(r[1] for r in refs) / dp
        rmine = refs[mine][1]
        loss.backward()
        rloss.backward()
        if step == 0:
            counted = {ph: sum(v for (t, p), v in pm.grid.log.bytes.items() if t.startswith("context") and p == ph)
                       for ph in ("fwd", "bwd")}
            if expect_recompute:  # a recomputed block's attention moves its forward bytes again in backward
                counted["recompute"] = sum(v for (t, p), v in pm.grid.log.bytes.items()
                                           if t.startswith("context") and p == "recompute")
            errs.update(group_excess({"output": (_whole(y), ry)}))
            errs.update(group_excess({n: (_whole(p.grad), ref_params[n].grad) for n, p in pm.named_parameters()},
                                     prefix="grad "))
        errs.update(group_excess({f"loss step {step}": (_whole(loss).detach(), rmine.detach())}))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    errs.update(group_excess({n: (_whole(p), ref_params[n]) for n, p in pm.named_parameters()},
                             prefix=f"param after {steps} steps "))
    want = options.get("context_attention", "auto")
    expected = _expected(family, grid[-2:], cp, seq, batch // dp, y, want)
    # what each attention module was planned to receive (explain's context line), against the priced shapes
    modules = [m for m in pm.program.gm.modules() if isinstance(m, ContextAttention)]
    planned = sum(step_bytes(*m.blocks, cp, m.flavour)[0] for m in modules)
    kinds = sorted({m.flavour for m in modules})
    if expect_recompute:
        expected["recompute"] = expected["attention fwd"]
    counted["planned attention fwd"], expected["planned attention fwd"] = planned, expected.pop("attention fwd")
    line = [ln for ln in autopar.explain(pm).splitlines() if ln.startswith("context parallel")]
    return {"excess": errs, "bytes": counted, "expected": expected, "flavours": kinds, "asked": want, "explain": line}


def _expected(family: str, grid: tuple, cp: int, seq: int, batch: int, y, want: str) -> dict:
    """The step's bytes as priced: q blocks [b/R, heads/C, s/cp, d], K and V blocks [b/R, kv heads/C, s/cp, d] per
    attention (transformers' repeated KV heads moved before the repeat), in the flavour this rank's heads allow;
    the per-token output's block; the loss."""
    rows, cols = grid
    n = seq // cp
    kv_heads, d, layers = {"gpt": (4, 8, 2), "encoder": (4, 8, 1), "neox": (4, 8, 2)}.get(family, (2, 8, 2))
    heads, kv_heads = 4 // cols, kv_heads // cols  # this rank's
    q_block, kv_block = batch // rows * heads * n * d * 4, batch // rows * kv_heads * n * d * 4
    fwd = bwd = 0
    for _ in range(layers):
        kind = flavour(heads, kv_heads, cp, want)
        if kind == "alltoall":
            f, b = alltoall_bytes(q_block, kv_block, cp)
        elif kind == "ring":
            f, b = ring_bytes(kv_block, cp)
        else:
            f, b = attention_bytes(kv_block, cp)
        fwd, bwd = fwd + f, bwd + b
    attention = fwd
    local = y.to_local() if hasattr(y, "to_local") else y
    fwd += output_bytes(local.numel() // cp * 4, cp)
    if family != "encoder":
        fwd += loss_bytes(4, cp)
    return {"fwd": fwd, "bwd": bwd, "attention fwd": attention}


def generated(rank):
    """Greedy generation at cp 2 x 1x2 (each cp copy of the grid generates the whole sequence) against
    transformers' generate on one process: the same tokens on every rank."""
    torch.set_num_threads(1)
    model = _model("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    pm = autopar.parallelize(model, grid=(1, 2), example_kwargs=dict(input_ids=ids, labels=ids), context_parallel=2)
    out = pm.generate(ids[:, :6], max_new_tokens=5, do_sample=False)
    want = ref.generate(ids[:, :6], max_new_tokens=5, do_sample=False, use_cache=True,
                        attention_mask=torch.ones_like(ids[:, :6]), pad_token_id=0)
    return {"same": torch.equal(out, want), "got": out.tolist(), "want": want.tolist()}


def saved(rank, family: str, grid: tuple, cp: int, path: str, seq: int = 16):
    """Two steps at context_parallel=cp, then save_pretrained: the files, loaded by transformers on one process,
    hold the parameters the unmodified model has after the same steps."""
    torch.set_num_threads(1)
    model = _model(family)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, grid=grid, example_kwargs=_batch(family, 4, seq, 1)[1], context_parallel=cp)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pm, ref))
    for step in range(2):
        kwargs = _batch(family, 4, seq, step + 1)[1]
        pm(**kwargs).loss.backward()
        ref(**kwargs).loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    pm.save_pretrained(path)
    dist.barrier()
    loaded = type(ref).from_pretrained(path)
    mine = dict(loaded.named_parameters())
    return {"excess": group_excess({n: (mine[n], p) for n, p in ref.named_parameters()}, prefix="loaded ")}


def refusals(rank):
    """What context parallelism does not run is refused by name, on every rank alike (4 ranks, cp 4 or 2)."""
    torch.set_num_threads(1)
    seen = {}

    def expect(what, match, fn):
        with pytest.raises(UsageError, match=match):
            fn()
        seen[what] = True

    gpt = _model("gpt")
    ids = torch.randint(0, VOCAB, (2, 12))
    expect("length", r"2 \* cp = 8 chunks .* sequence length is 12",
           lambda: autopar.parallelize(gpt, grid=(1, 1), example_inputs=(ids, ids), context_parallel=4))
    llama = _model("llama")
    ids = torch.randint(0, VOCAB, (2, 16))
    expect("padding mask", "attention_mask with context_parallel=4: padding masks are not supported",
           lambda: autopar.parallelize(llama, grid=(1, 1), example_kwargs=dict(
               input_ids=ids, attention_mask=torch.ones_like(ids)), context_parallel=4))
    expect("window", "sliding_window=8: windowed or chunked attention is not supported",
           lambda: autopar.parallelize(_hf("mistral", sliding_window=8), grid=(1, 1),
                                       example_kwargs=dict(input_ids=ids), context_parallel=4))
    expect("replicas", r"not yet with pipeline stages, data_parallel='auto'",
           lambda: autopar.parallelize(llama, grid=(2, 1, 1), example_kwargs=dict(input_ids=ids), context_parallel=2,
                                       data_parallel="auto"))
    expect("world", r"context_parallel=4 on grid=\(2, 1, 1\) needs 2 \* 4 \* 1 \* 1 = 8 processes",
           lambda: autopar.parallelize(llama, grid=(2, 1, 1), example_kwargs=dict(input_ids=ids), context_parallel=4))
    expect("world 1x1", r"context_parallel=2 on grid=\(1, 1\) needs 2 \* 1 \* 1 = 2 processes",
           lambda: autopar.parallelize(llama, grid=(1, 1), example_kwargs=dict(input_ids=ids), context_parallel=2))
    pm = autopar.parallelize(llama, grid=(1, 1), example_kwargs=dict(input_ids=ids), context_parallel=4)
    own = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))  # as a replica would
    expect("own batch", "the 4 context-parallel ranks of this grid position were passed different batches",
           lambda: pm(input_ids=own))

    class Shifted(nn.Module):  # the loss of next-token logits taken inside the model: a shift over the tokens
        def __init__(self):
            super().__init__()
            self.inner = _model("gpt")

        def forward(self, ids):
            logits = self.inner(ids)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    expect("shift", r"the target of the loss .* is not a \[batch, sequence\] tensor computed from the inputs",
           lambda: autopar.parallelize(Shifted(), grid=(1, 1), example_inputs=(ids,), context_parallel=4))

    class Running(nn.Module):  # a running sum over the tokens
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).cumsum(1)

    expect("running sum", r"cumsum.* works along a dim of the local sequence length 4",
           lambda: autopar.parallelize(Running(), grid=(1, 1), example_inputs=(torch.randn(2, 16, 8),),
                                       context_parallel=4))

    class Masked(nn.Module):  # a mask the caller passes (padding): not a constant of the graph
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, keep):
            q = self.proj(x).unsqueeze(1)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=keep[:, None, None, :]).squeeze(1)

    class Eager(nn.Module):  # attention as matmul and softmax: each rank would mix its own tokens only
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x)
            return torch.softmax(q @ q.transpose(1, 2), -1) @ q

    expect("eager attention", r"makes an \[4, 4\] product of the local tokens",
           lambda: autopar.parallelize(Eager(), grid=(1, 1), example_inputs=(torch.randn(2, 16, 8),),
                                       context_parallel=4))
    x, m = torch.randn(2, 16, 8), torch.ones(2, 16, dtype=torch.bool)
    expect("mask input", "takes a mask that is not the causal triangle built from sizes .*padding mask",
           lambda: autopar.parallelize(Masked(), grid=(1, 1), example_inputs=(x, m), context_parallel=4))
    return seen


def tmp_dir(rank) -> str:
    """One directory every rank names alike (rank 0's, broadcast)."""
    box = [tempfile.mkdtemp(prefix="autopar-cp-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    os.makedirs(box[0], exist_ok=True)
    return box[0]


def dcp_across(rank, path: str):
    """A torch.distributed.checkpoint save after two steps at cp 2 x 1x2, loaded at cp 4 x 1x1 (sharded blocks)
    and at cp 1 x 2x2: every parameter equals the saved one, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.set_num_threads(1)
    batch = _batch("llama", 4, 16, 1)[1]
    pm = autopar.parallelize(_model("llama"), grid=(1, 2), example_kwargs=batch, context_parallel=2)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for step in range(2):
        pm(**_batch("llama", 4, 16, step + 1)[1]).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(pm)}, checkpoint_id=path)
    saved = {n: _whole(p).detach().clone() for n, p in pm.named_parameters()}
    errs = {}
    for grid, cp, mode in (((1, 1), 4, "shard"), ((2, 2), 1, "replicate")):
        torch.manual_seed(7)  # other values: the load must overwrite every one
        other = autopar.parallelize(_hf("llama"), grid=grid, example_kwargs=batch, context_parallel=cp,
                                    data_parallel=mode)
        msd = get_model_state_dict(other)
        dcp.load({"model": msd}, checkpoint_id=path)
        set_model_state_dict(other, msd)
        errs.update(group_excess({n: (_whole(p), saved[n]) for n, p in other.named_parameters()}, rtol=0.0,
                                 frac=0.0, prefix=f"cp {cp} x {grid} "))
    return {"excess": errs}
