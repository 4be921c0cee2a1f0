"""Load a checkpoint written by transformers' own save_pretrained on a 2x2 grid, check it against
transformers' from_pretrained on one process, and save it back in the layout transformers writes.

GPT-NeoX is the example because its file names the head `embed_out` while the model calls it
`lm_head`: autopar maps the keys with transformers' own rules. Nothing is downloaded (a tiny model is
built from its config class). Run: `python examples/reload_hf.py` (spawns 4 gloo processes) or
`torchrun --nproc-per-node 4 examples/reload_hf.py`.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.launch import run  # noqa: E402

DIR = os.path.join(tempfile.gettempdir(), "autopar_reload_example")
CONFIG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def main(rank: int) -> None:
    src, out = os.path.join(DIR, "hf"), os.path.join(DIR, "autopar")
    if rank == 0:  # a checkpoint as transformers writes it: the head is stored as embed_out.weight
        torch.manual_seed(0)
        transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**CONFIG)).save_pretrained(src)
    dist.barrier()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    pm = autopar.from_pretrained(src, grid=(2, 2), example_kwargs=dict(input_ids=ids))  # each rank reads its blocks
    pm.eval()
    logits = pm(input_ids=ids).logits.full_tensor()
    autopar.save_pretrained(pm, out)  # written under the names transformers writes (embed_out.weight)
    if rank == 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            again = back(input_ids=ids).logits
        print(f"2x2 logits vs transformers: max |diff| {(logits - want).abs().max():.2e}")
        print(f"autopar's save read by transformers: max |diff| {(again - want).abs().max():.2e}")


if __name__ == "__main__":
    run(main, 4)
