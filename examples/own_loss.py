"""Your own loss on a ParallelModule's outputs, written as on one process, checked against one process.

    python examples/own_loss.py        # spawns 4 gloo processes: a 2x2 grid

A tiny transformers Llama returns its logits split (batch over rows, vocabulary over columns); the
cross-entropy below runs vocab-parallel on them (the logits are never gathered) and an mse on the
hidden states runs on the blocks. Prints the loss, the bytes it moved per rank and the largest
gradient difference against the unmodified model.
"""

import copy

import torch
import torch.nn.functional as F
import transformers

import autopar
from autopar.launch import spawn
from autopar.program.outputs import LOSS_TAG


def main(rank):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 64, (4, 8))
    labels = torch.randint(0, 64, (4, 8))
    labels[:, :2] = -100  # positions that are not predicted
    target = torch.randn(4, 8, 32)
    pmodel = autopar.parallelize(model, grid=(2, 2), example_kwargs=dict(input_ids=ids))

    def loss_of(m):
        out = m(input_ids=ids, output_hidden_states=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())  # plain labels, as on one process
        return ce + 0.1 * F.mse_loss(out.hidden_states[-1], target)

    pmodel.grid.log.reset()
    loss = loss_of(pmodel)  # a plain tensor, equal on every rank
    moved = pmodel.grid.log.total(LOSS_TAG)
    loss.backward()
    want = loss_of(ref)
    want.backward()
    ref_grads = dict(ref.named_parameters())
    worst = max(float((p.grad.full_tensor() - ref_grads[n].grad).abs().max()) for n, p in pmodel.named_parameters())
    if rank == 0:
        print(f"loss {loss.item():.6f} (one process {want.item():.6f}); the loss moved {moved} B per rank; "
              f"largest gradient difference {worst:.2e}")


if __name__ == "__main__":
    spawn(main, 4)
