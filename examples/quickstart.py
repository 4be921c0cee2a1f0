"""autopar's quick start: a small language model trained on a 2x2 grid of 4 processes.

    torchrun --nproc-per-node 4 examples/quickstart.py
"""

import torch
import torch.distributed as dist
from torch import nn

import autopar


class TinyLM(nn.Module):
    """Your own nn.Module, untouched: an embedding, one MLP block and a head."""

    def __init__(self, vocab: int = 256, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, targets):
        h = self.embed(ids)
        h = h + self.mlp(h)
        logits = self.head(h)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int):
    """The same batch on every rank of the grid: seeded alike (not per rank, as under DDP)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g)


def main():
    dist.init_process_group("gloo")  # torchrun gives RANK and WORLD_SIZE; 4 processes for a 2x2 grid
    torch.manual_seed(0)  # the same initial weights on every rank
    pmodel = autopar.parallelize(TinyLM(), grid=(2, 2), example_inputs=batch(0))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)  # parameters are DTensor blocks: optimizers just work
    for step in range(3):
        logits, loss = pmodel(*batch(step))  # logits: a DTensor split over the grid; loss: a plain tensor
        loss.backward()
        pmodel.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    if dist.get_rank() == 0:
        lines = autopar.explain(pmodel).splitlines()
        print(next(line for line in lines if "bytes received per rank" in line))  # each rank's bytes per step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
