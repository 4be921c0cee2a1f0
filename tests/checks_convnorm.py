"""Rank-side checks for grouped/depthwise convolutions and batch norm: a small CNN trained on the grid
against one process. Returns plain data (per-name excess from tests/compare.py, planned and counted
collective bytes and calls) for the test to assert on."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.planning.explain import rows
from tests.compare import group_excess


class SmallCNN(nn.Module):
    """A stem conv (3 input channels), batch norm, a depthwise 3x3 conv (groups = channels), batch norm,
    a grouped 1x1 conv (groups 4), an ordinary 3x3 conv, batch norm without affine parameters; max and
    adaptive average pooling."""

    def __init__(self, ch: int = 8, classes: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(ch)
        self.dw = nn.Conv2d(ch, ch, 3, padding=1, groups=ch)
        self.bn2 = nn.BatchNorm2d(ch, momentum=0.3)
        self.pw = nn.Conv2d(ch, ch, 1, groups=4, bias=False)
        self.mix = nn.Conv2d(ch, ch, 3, padding=1)  # input channels the rows divide: weight stored 1/(RC)
        self.bn3 = nn.BatchNorm2d(ch, affine=False)
        self.head = nn.Linear(ch, classes)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn1(self.stem(x))), 2)
        h = F.relu(self.bn2(self.dw(h)))
        h = self.bn3(self.mix(self.pw(h)))
        logits = self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return logits, F.cross_entropy(logits, y)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _batch(step: int, n: int = 4):
    g = torch.Generator().manual_seed(step)
    # an offset far from zero: the shifted statistics must not lose the spread to the mean
    return torch.randn(n, 3, 6, 6, generator=g) * 2 + 3, torch.randint(0, 4, (n,), generator=g)


def cnn_parity(rank, grid, steps: int = 2):
    """Outputs, loss, every gradient, the running statistics and the parameters after `steps` SGD
    steps in train mode, then eval-mode outputs, against one process; and planned == counted
    collective bytes and calls of one training step."""
    torch.manual_seed(0)
    model = SmallCNN()
    ref = copy.deepcopy(model)
    x, y = _batch(0)
    pm = autopar.parallelize(model.train(), grid=grid, example_inputs=(x, y))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    errs, planned, counted = {}, None, None
    for step in range(steps):
        x, y = _batch(step)
        pm.grid.log.reset()
        logits, loss = pm(x, y)
        ref_logits, ref_loss = ref(x, y)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            log = pm.grid.log
            counted = (log.total(), log.calls())
            table = rows(pm)
            planned = (sum(r.fwd_bytes + r.bwd_bytes for r in table), sum(r.calls_fwd + r.calls_bwd for r in table))
            errs.update(group_excess({"logits": (_full(logits), ref_logits), "loss": (_full(loss), ref_loss)}))
            errs.update(group_excess({n: (_full(p.grad), ref_params[n].grad) for n, p in pm.named_parameters()},
                                     prefix="grad "))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_bufs = dict(ref.named_buffers())
    errs.update(group_excess({n: (_full(b).float(), ref_bufs[n].float()) for n, b in pm.named_buffers()},
                             prefix=f"buffer after {steps} steps "))
    errs.update(group_excess({n: (_full(p), ref_params[n]) for n, p in pm.named_parameters()},
                             prefix=f"param after {steps} steps "))
    x, y = _batch(steps)
    pm.eval()
    ref.eval()
    with torch.no_grad():
        logits, _ = pm(x, y)
        errs.update(group_excess({"eval logits": (_full(logits), ref(x, y)[0])}))
    kernels = sorted({r.op.split("(")[0] for r in table} & {"SplitConv", "SplitBatchNorm"})
    held = {n: p.to_local().numel() for n, p in pm.named_parameters() if n.endswith("weight")}
    return {"held": held, "excess": errs, "planned": planned, "counted": counted, "kernels": kernels,
            "fallbacks": [r.node for r in rows(pm) if r.fallback]}
