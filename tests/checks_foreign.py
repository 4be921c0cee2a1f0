"""Rank-side checks for model code written the way other projects write it (torchtitan's config
dataclasses, x-transformers' rotary helper), without depending on those projects."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
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


def slots_config_and_last_dim_unbind(rank):
    """RotaryBlock at 2x2: the loss and every gradient against one process, what `pmodel.config`
    reads, and whether the user's config object was left without a new attribute."""
    torch.manual_seed(0)
    model = RotaryBlock()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, grid=(2, 2), example_inputs=(x,))
    loss, ref_loss = pm(x), ref(x)
    loss.backward()
    ref_loss.backward()
    full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    ref_params = dict(ref.named_parameters())
    errs = group_excess({"loss": (full, ref_loss)})
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             prefix="grad "))
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
    loss, ref_loss = pm(x).pow(2).mean(), ref(x).pow(2).mean()  # a loss on the split output
    loss.backward()
    ref_loss.backward()
    full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    ref_params = dict(ref.named_parameters())
    errs = group_excess({"loss": (full, ref_loss)})
    errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                             prefix="grad "))
    return {"excess": errs, "choice": dict(pm.choice.assignment)}
