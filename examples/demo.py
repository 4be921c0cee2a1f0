"""The main example: a small GPT parallelized 2D on a 2x2 grid of 4 local processes.

    python examples/demo.py                          # spawns 4 gloo processes itself
    torchrun --nproc-per-node 4 examples/demo.py     # or let torchrun start them

One AdamW training step, a parity check against the same model on one process, and the `explain`
table of what the compiler did.
"""

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.launch import run  # noqa: E402
from models import GPTConfig, TinyGPT  # noqa: E402


def main(rank: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, max_seq=32, hidden=64, heads=4, layers=2))
    reference = copy.deepcopy(model)  # the same model, trained on this one process for comparison
    ids = torch.randint(0, 256, (8, 32))  # [batch, seq]; every rank passes the same full batch
    targets = torch.randint(0, 256, (8, 32))

    pmodel = autopar.parallelize(model, grid=(2, 2), example_inputs=(ids, targets))
    # Adam divides by |grad| + eps; with the default eps=1e-8, elements whose gradient is at fp32
    # rounding level get steps that differ by up to ~1e-3 relative between any two summation orders
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)

    logits, loss = pmodel(ids, targets)  # logits: a DTensor [8, 32, 256], split 2D
    loss.backward()
    ref_logits, ref_loss = reference(ids, targets)
    ref_loss.backward()

    ref_grads = dict(reference.named_parameters())
    grad_err = max(
        ((p.grad.full_tensor() - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
        for n, p in pmodel.named_parameters()
    )
    opt.step()
    ref_opt.step()
    param_err = max(
        ((p.full_tensor() - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
        for n, p in pmodel.named_parameters()
    )
    logit_err = ((logits.full_tensor() - ref_logits).abs().max() / ref_logits.abs().max()).item()
    if rank == 0:
        print(autopar.explain(pmodel))
        print()
        print(f"loss: 2x2 grid {loss.item():.6f}, one process {ref_loss.item():.6f}")
        print(f"max relative error vs one process: logits {logit_err:.1e}, gradients {grad_err:.1e}, "
              f"parameters after one AdamW step {param_err:.1e}")
        ok = max(logit_err, grad_err, param_err) < 1e-4
        print("parity: OK" if ok else "parity: FAILED")
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    run(main, 4)
