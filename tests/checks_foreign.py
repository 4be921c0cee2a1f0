"""Rank-side checks for model code written the way other projects write it (torchtitan's config
dataclasses, x-transformers' rotary helper), without depending on those projects."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from tests.compare import group_excess


@dataclass(slots=True)
class SlotsConfig:
    """torchtitan keeps a model's arguments as a `slots=True` dataclass in `self.config`: no attribute
    can be added to it, nor to a copy of it."""

    dim: int = 32


class RotaryBlock(nn.Module):
    """A projection, x-transformers' rotate-half on pairs of the hidden dim (viewed as a last dim of 2
    and unbound), and an output projection; the loss inside the model."""

    def __init__(self):
        super().__init__()
        self.config = SlotsConfig()
        self.inp = nn.Linear(32, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        h = self.inp(x)  # [b, s, 32]
        a, b = h.view(*h.shape[:-1], 16, 2).unbind(-1)  # [b, s, 16] each
        rotated = torch.stack((-b, a), dim=-1).flatten(-2)  # [b, s, 32]
        return self.out(h * 0.5 + rotated).pow(2).mean()


def _step_excess(pm, ref, x, loss_of=lambda out: out) -> dict:
    """One forward and backward of `pm` and of `ref` (the unmodified model) on `x` (a tuple: the
    positional inputs): the excess of the loss and of every gradient, by parameter name, over fp32
    parity tolerances."""
    args = x if isinstance(x, tuple) else (x,)
    loss, ref_loss = loss_of(pm(*args)), loss_of(ref(*args))
    loss.backward()
    ref_loss.backward()
    full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    ref_params = dict(ref.named_parameters())
    errs = group_excess({"loss": (full, ref_loss)})
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             prefix="grad "))
    return errs


def slots_config_and_last_dim_unbind(rank):
    """RotaryBlock at 2x2: the loss and every gradient against one process, what `pmodel.config`
    reads, and whether the user's config object was left without a new attribute."""
    torch.manual_seed(0)
    model = RotaryBlock()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,))
    errs = _step_excess(pm, ref, x)
    return {"excess": errs, "dim": pm.config.dim, "tp_size": pm.config.distributed_config.tp_size,
            "user config": repr(model.config)}


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention as nanoGPT writes it: a fused c_attn split into q, k, v, heads by
    view + transpose, SDPA, then `y.transpose(1, 2).contiguous().view(B, T, C)` (capture drops the
    `.contiguous()`: after CPU SDPA the transpose is contiguous already) and c_proj."""

    def __init__(self, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def nano_attention_auto(rank):
    """NanoAttention at 2x2 with strategy='auto' (the default cost model chooses c_attn replicated,
    c_proj 1D: a view of a head block whose strides one process never had): loss and every gradient
    against one process, and the choice made."""
    torch.manual_seed(0)
    model = NanoAttention()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,), strategy="auto")
    errs = _step_excess(pm, ref, x, lambda out: out.pow(2).mean())  # a loss on the split output
    return {"excess": errs, "choice": dict(pm.choice.assignment)}


def _freqs_cis(head_dim: int, seq: int) -> torch.Tensor:
    """torchtitan's precompute_freqs_cis: e^(i t theta_k), complex [seq, head_dim / 2]."""
    theta = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), theta)
    return torch.polar(torch.ones_like(angles), angles)


class ComplexRotaryGQA(nn.Module):
    """Attention as torchtitan's Llama 3 writes its rotary embedding (q and k viewed as complex pairs,
    multiplied by a complex buffer, viewed back as real) and as litgpt repeats grouped KV heads
    (`repeat_interleave` over the head dim): 4 query heads, 2 KV heads, hidden 32."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, seq: int = 8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(self.head_dim, seq), persistent=False)

    def _rotate(self, t, heads):
        b, s = t.shape[:2]
        pairs = torch.view_as_complex(t.float().reshape(b, s, heads, -1, 2))
        return torch.view_as_real(pairs * self.freqs_cis[:s].view(1, s, 1, -1)).flatten(3).type_as(t)

    def forward(self, x):
        b, s, _ = x.shape
        q = self._rotate(self.wq(x).view(b, s, self.heads, self.head_dim), self.heads)
        k = self._rotate(self.wk(x).view(b, s, self.kv_heads, self.head_dim), self.kv_heads)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=2)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=2)
        y = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def complex_rotary_gqa(rank, grid):
    """ComplexRotaryGQA at `grid`: loss and every gradient against one process, the ops that fell back
    (none: view_as_complex, view_as_real and repeat_interleave have rules) and the step's bytes."""
    torch.manual_seed(0)
    model = ComplexRotaryGQA()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, grid=grid, example_inputs=(x,))
    errs = _step_excess(pm, ref, x, lambda out: out.pow(2).mean())
    return {"excess": errs, "fallbacks": [f.node.name for f in pm.program.fallbacks],
            "warned": [str(w.message)[:200] for w in caught if issubclass(w.category, autopar.FallbackWarning)]}


class CastWeight(nn.Module):
    """A weight stored in float64 and cast before its product (as torchtitan's DeepSeek-V3 casts its
    fp32 experts to bf16 before the grouped product), then a Linear."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32, dtype=torch.float64) / 4)
        self.lin = nn.Linear(32, 16)

    def forward(self, x):
        return self.lin(x @ self.w.float())


def cast_weight(rank):
    """CastWeight at 2x2: the loss and every gradient (the float64 one included) against one process,
    and the stored layout of the cast weight."""
    torch.manual_seed(0)
    model = CastWeight()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,))
    errs = _step_excess(pm, ref, x, lambda out: out.pow(2).mean())
    return {"excess": errs, "w placements": repr(pm.w.placements), "w dtype": str(pm.w.dtype)}


class TitanExperts(nn.Module):
    """Experts written the way torchtitan's DeepSeek-V3 writes them: fp32 weights [E, out, in], each
    cast to bf16 and transposed right before `torch._grouped_mm` over tokens sorted by expert, a SwiGLU
    between the products, and the result cast back; a Linear on either side. With `scaled`, each
    weight is first multiplied by a factor (an op that runs whole: the experts then stay whole)."""

    def __init__(self, dim: int = 16, hidden: int = 32, experts: int = 4, scaled: bool = False):
        super().__init__()
        self.scale = 0.5 if scaled else None
        self.inp = nn.Linear(dim, dim)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / 4)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / 4)
        self.out = nn.Linear(dim, dim)

    def _w(self, w):
        return (w if self.scale is None else w * self.scale).bfloat16().transpose(-2, -1)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = self.inp(x).bfloat16()
        g = torch._grouped_mm(h, self._w(self.w1), offs=offs)
        u = torch._grouped_mm(h, self._w(self.w3), offs=offs)
        y = torch._grouped_mm(torch.nn.functional.silu(g) * u, self._w(self.w2), offs=offs)
        return self.out(y.type_as(x))


def titan_experts(rank, scaled: bool = False):
    """TitanExperts at 2x2 (tokens already sorted by expert, four experts on two rows): the loss and
    every gradient as relative errors against one process (bf16 products), the experts' stored
    placements, and the fallback warnings."""
    torch.manual_seed(0)
    model = TitanExperts(scaled=scaled)
    ref = copy.deepcopy(model)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([5, 7, 4, 8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x, counts))
    loss, want = pm(x, counts).pow(2).mean(), ref(x, counts).pow(2).mean()
    loss.backward()
    want.backward()

    def rel(got, w):
        got = (got.full_tensor() if hasattr(got, "full_tensor") else got).detach().float()
        w = w.detach().float()
        return float((got - w).norm() / w.norm().clamp_min(1e-12))

    mine = dict(pm.named_parameters())
    errs = {"loss": rel(loss, want)}
    errs.update({f"grad {n}": rel(mine[n].grad, p.grad) for n, p in ref.named_parameters()})
    return {"errs": errs, "placements": {n: repr(mine[n].placements) for n in ("w1", "w2", "w3")},
            "warned": [str(w.message) for w in caught if issubclass(w.category, autopar.FallbackWarning)]}


def bench_tp_sp_parity(rank) -> dict:
    """`autopar bench`'s torchtitan-style baseline (`common.tp_sp`: PyTorch's 1D TP with sequence
    parallelism and the loss over vocabulary blocks) on a tiny Llama against one process: the loss
    and every gradient, by parameter name."""
    import transformers

    from autopar.bench import common
    from autopar.planning.explain import rows

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                   pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    b = dict(input_ids=ids, labels=ids)
    ours = copy.deepcopy(model)
    want = ref(**b).loss
    want.backward()
    tp = common.tp_sp(model)
    with common.FunctionalCommBytes(dist.get_world_size()) as counter:
        got = common.forward_backward(tp, b)
    mine = dict(tp.named_parameters())
    errs = group_excess({"loss": (got.full_tensor(), want)})
    errs.update(group_excess({n: (mine[n].grad.full_tensor(), p.grad) for n, p in ref.named_parameters()},
                             prefix="grad "))
    # autopar's 2D on the same model and batch, default options: its launches beside the baseline's
    pm = autopar.parallelize(ours, grid=(2, 2), example_kwargs=b)
    pm.grid.log.reset()
    out = pm(**b)
    out.loss.backward()
    planned = sum(r.calls_fwd + r.calls_bwd for r in rows(pm))
    grads = dict(pm.named_parameters())
    ours_errs = group_excess({"loss": (out.loss, want)})
    ours_errs.update(group_excess({n: (grads[n].grad.full_tensor(), p.grad) for n, p in ref.named_parameters()},
                                  prefix="grad "))
    lowerings = sorted({m.lowering for m in pm.graph_module.modules() if hasattr(m, "lowering")})
    return {"errs": errs, "names": sorted(mine), "tp_sp calls": counter.calls, "2d calls": pm.grid.log.calls(),
            "2d planned calls": planned, "2d errs": ours_errs, "2d lowerings": lowerings}


class _RMS(nn.Module):
    """RMSNorm written out (pow, mean, rsqrt), as transformers writes it."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


class PreNormMLP(nn.Module):
    """Pre-norm residual blocks as torchtitan writes them: `nn.RMSNorm` (one aten.rms_norm), the
    residual summed straight from the embedding and each block's output projection; with
    `written_out`, the same model with the norm written out as transformers does."""

    def __init__(self, written_out: bool = False, vocab: int = 64, dim: int = 32, layers: int = 2):
        super().__init__()
        norm = (lambda: _RMS(dim)) if written_out else (lambda: nn.RMSNorm(dim, eps=1e-5))
        self.tok = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(norm() for _ in range(layers + 1))
        self.w1 = nn.ModuleList(nn.Linear(dim, 2 * dim, bias=False) for _ in range(layers))
        self.w2 = nn.ModuleList(nn.Linear(2 * dim, dim, bias=False) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        h = self.tok(ids)
        for norm, w1, w2 in zip(self.norms, self.w1, self.w2):
            h = h + w2(torch.nn.functional.silu(w1(norm(h))))
        logits = self.out(self.norms[-1](h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def prenorm_sequence_parallel(rank, grid, written_out: bool):
    """PreNormMLP under strategy='1d' at `grid`: loss and every gradient against one process, and the
    bytes and calls one step counts."""
    torch.manual_seed(0)
    model = PreNormMLP(written_out)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    pm = autopar.parallelize(model, grid=grid, example_inputs=(ids, labels), strategy="1d")
    pm.grid.log.reset()
    errs = _step_excess(pm, ref, (ids, labels))
    return {"excess": errs, "bytes": pm.grid.log.total(), "calls": pm.grid.log.calls()}
