"""A model as a user writes it, with no `config`, for `autopar inspect tests.cli_own_model:build`."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, h: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build():
    """(model, example inputs): three blocks of hidden 32 on a batch of 4 x 8 tokens."""
    torch.manual_seed(0)
    return Stack(), (torch.randn(4, 8, 32),)


class Differences(nn.Module):
    """A matmul then `torch.diff`, an op with no split form (it runs whole, its input gathered)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.diff(self.lin(x), dim=-1)


def build_with_fallback():
    torch.manual_seed(0)
    return Differences(), (torch.randn(4, 8, 16),)
