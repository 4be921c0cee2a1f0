"""Rank-side checks for the transpose-alias, grouped-query attention and indexing rules: small modules
and transformers models run forward and backward on the grid against one process. Each returns plain
data (per-name excess from tests/compare.py, parameter bytes) for the test to assert on."""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tests import checks_hf
from tests.compare import group_excess

B, S, H = 4, 6, 24  # hidden 24: 6 query heads of 4


class MultiQuery(nn.Module):
    """Falcon's multi-query block written out: a fused query_key_value used through `.T`, the key and
    value heads picked by advanced indexing, attention of 6 query heads on 1 broadcast KV head, then
    grouped-query attention (enable_gqa) of the same queries on `kv` KV heads, an output projection
    through `.mT`, and a gather of chosen positions per sequence (`h[arange, pos]`)."""

    def __init__(self, kv: int):
        super().__init__()
        self.heads, self.kv, self.d = 6, kv, H // 6
        self.qkv = nn.Parameter(torch.randn(H + 2 * self.d, H) / H ** 0.5)  # [6 q heads + k + v, h]
        self.kv_proj = nn.Parameter(torch.randn(2 * kv * self.d, H) / H ** 0.5)
        self.out = nn.Parameter(torch.randn(H, H) / H ** 0.5)

    def forward(self, x, pos):
        b, s, _ = x.shape
        fused = (x @ self.qkv.T).view(b, s, self.heads + 2, self.d)  # [b, s, 8, d]
        q = fused[:, :, :-2].transpose(1, 2)  # [b, 6, s, d]
        k = fused[:, :, [-2]].transpose(1, 2)  # [b, 1, s, d]
        v = fused[:, :, [-1]].transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # broadcast over the heads
        kv = (x @ self.kv_proj.swapaxes(0, 1)).view(b, s, 2 * self.kv, self.d).transpose(1, 2)
        k2, v2 = kv.chunk(2, dim=1)  # [b, kv, s, d] each
        a = a + F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True)
        h = a.transpose(1, 2).reshape(b, s, H) @ self.out.mT  # [b, s, h]
        return h, h[torch.arange(b), pos]  # [b, s, h], [b, h]


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def module_parity(rank, kv, grid):
    """MultiQuery's two outputs and every gradient on every rank against one process."""
    torch.manual_seed(0)
    model = MultiQuery(kv)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, pos = torch.randn(B, S, H, generator=g), torch.randint(0, S, (B,), generator=g)
    pm = autopar.parallelize(model, grid=grid, example_inputs=(x, pos))
    out, want = pm(x, pos), ref(x, pos)
    ((_full(out[0]) ** 2).sum() + _full(out[1]).sum()).backward()
    ((want[0] ** 2).sum() + want[1].sum()).backward()
    errs = group_excess({f"out {i}": (_full(o), w) for i, (o, w) in enumerate(zip(out, want))})
    mine = _grads(pm)
    errs.update(group_excess({n: (_full(mine[n]), w) for n, w in _grads(ref).items()}, prefix="grad "))
    return {"excess": errs, "gathered": [str(f.node.target) for f in pm.program.fallbacks if f.costly],
            "layouts": {n: "".join(map(str, p.placements)) for n, p in pm.named_parameters()}}


def hf_parity(rank, family, grid, force_gqa=False, over=None):
    """checks_hf.hf_parity on a family of checks_hf.build (config overrides `over`), with transformers'
    SDPA path forced to pass fewer KV heads with enable_gqa=True (it does so on CUDA when there is no
    mask) when asked; adds the parameter bytes this rank holds. One input shape."""
    if force_gqa:
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        res = checks_hf.hf_parity(rank, family, over, grid=grid, other_shape=None)  # a second shape: test_hf.py
        model, _ = checks_hf.build(family, **(over or {}))
        res["full_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        return res
    finally:
        os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)


class Einsums(nn.Module):
    """Relative attention written with einsum as Funnel does: projections with 3-D weights, content
    scores with a bias added to the queries, position scores against a parameter, the weighted sum of
    values (with an ellipsis), the output projection summing two letters, and an implicit scalar."""

    def __init__(self, heads: int = 6, d: int = 4):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(H, heads, d) / H ** 0.5) for _ in range(3))
        self.bias = nn.Parameter(torch.randn(heads, d))
        self.pos = nn.Parameter(torch.randn(S, heads, d))
        self.wo = nn.Parameter(torch.randn(heads, d, H) / H ** 0.5)

    def forward(self, x):
        q = torch.einsum("bsh,hnd->bsnd", x, self.wq)
        k = torch.einsum("bsh,hnd->bsnd", x, self.wk)
        v = torch.einsum("bsh,hnd->bsnd", x, self.wv)
        score = torch.einsum("bind,bjnd->bnij", q + self.bias, k) + torch.einsum("bind,jnd->bnij", q, self.pos)
        a = torch.einsum("...nij,...jnd->...ind", score.softmax(-1), v)
        out = torch.einsum("bind,ndh->bih", a, self.wo)
        return out, torch.einsum("bih,bih", out, x)


def einsum_parity(rank, grid):
    """Einsums' outputs and every gradient on every rank against one process, and what fell back."""
    torch.manual_seed(0)
    model = Einsums()
    ref = copy.deepcopy(model)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, grid=grid, example_inputs=(x,))
    out, want = pm(x), ref(x)
    ((_full(out[0]) ** 2).sum() + _full(out[1])).backward()
    ((want[0] ** 2).sum() + want[1]).backward()
    errs = group_excess({f"out {i}": (_full(o), w) for i, (o, w) in enumerate(zip(out, want))})
    mine = _grads(pm)
    errs.update(group_excess({n: (_full(mine[n]), w) for n, w in _grads(ref).items()}, prefix="grad "))
    held = {n: p.to_local().numel() / p.numel() for n, p in pm.named_parameters()}
    return {"excess": errs, "gathered": [str(f.node.target) for f in pm.program.fallbacks], "held": held}
