"""Small models written the way users write them: plain nn.Modules, no autopar imports.

`TinyGPT` is the model of the main example and of the engine's parity tests: token embedding plus
learned positions, pre-norm blocks (LayerNorm or RMSNorm), multi-head attention through
`scaled_dot_product_attention`, a GELU or SwiGLU MLP and an LM head tied to the token embedding.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 64
    max_seq: int = 16
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu"
    bias: bool = True
    dropout: float = 0.0


class RMSNorm(nn.Module):
    """Written out by hand, as many codebases do, so the graph holds pow/mean/rsqrt/mul."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layernorm" else RMSNorm(cfg.hidden)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        # no key bias (as in Whisper): softmax over keys cancels it, so its gradient is zero
        self.k = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)  # [b, nh, s, hd]
        k = self.k(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        y = y.transpose(1, 2).reshape(b, s, h)  # [b, s, h]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.kind = cfg.mlp
        inner = 4 * cfg.hidden
        self.up = nn.Linear(cfg.hidden, inner, bias=cfg.bias)
        if cfg.mlp == "swiglu":
            self.gate = nn.Linear(cfg.hidden, inner, bias=cfg.bias)
        self.down = nn.Linear(inner, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2's scale keeps the tied logits O(1)

    def forward(self, ids, targets=None):
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device)
        x = self.tok(ids) + self.pos(pos)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # [b, s, V]
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
