"""A transformers causal LM (Llama architecture, tiny, random weights) trained 2D-parallel on a 2x2 grid.

    python examples/hf_causal_lm.py                       # spawns 4 gloo processes
    torchrun --nproc-per-node 4 examples/hf_causal_lm.py

The model is built from its config class (nothing is downloaded) and trained for a few AdamW steps
with its own HF loss (`labels=`); the same model trained on one process runs alongside, and the two
loss curves are printed next to each other.
"""

import copy
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.launch import run  # noqa: E402

STEPS, BATCH, SEQ = 5, 8, 32


def main(rank: int) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1, config.vocab_size, (BATCH, SEQ), generator=g)
        return dict(input_ids=ids, labels=ids)  # HF shifts the labels inside its loss

    pmodel = autopar.parallelize(model, grid=(2, 2), example_kwargs=batch(0))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        loss = pmodel(**batch(step)).loss  # a plain tensor, the same on every rank
        loss.backward()
        torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(**batch(step)).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss 2x2 {loss.item():.6f}   one process {ref_loss.item():.6f}")
    summary = [line for line in autopar.explain(pmodel).splitlines() if line.startswith(("grid", "parameters"))]
    if rank == 0:
        print("\n".join(summary))  # bytes per rank per step; parameters held per rank


if __name__ == "__main__":
    run(main, 4)
