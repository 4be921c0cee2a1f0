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
