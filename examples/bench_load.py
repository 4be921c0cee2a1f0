"""Benchmark: peak memory (RSS) per rank while loading a checkpoint, 2x2 shard-on-read vs one process.

Writes a Llama-shaped checkpoint of a few hundred MB (random weights, from its config class) to a
temporary directory, then measures in fresh processes:
  - one process: transformers' own `from_pretrained`;
  - 2x2: `autopar.from_pretrained` on 4 gloo ranks (each reads only its blocks).
Peak RSS is ru_maxrss after the load minus the RSS before it (imports and process start-up excluded).
"""

import json
import os
import resource
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def single(path, out):
    import transformers

    before = _rss_mb()
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    with open(out, "w") as f:
        json.dump({"peak_mb": _peak_mb() - before, "params": sum(p.numel() for p in model.parameters())}, f)


def sharded(rank, path, out):
    import autopar

    ids = torch.randint(1, 1000, (4, 16))
    before = _rss_mb()
    autopar.from_pretrained(path, grid=(2, 2), example_kwargs=dict(input_ids=ids, labels=ids), progress=rank == 0)
    peaks = [None] * 4
    dist.all_gather_object(peaks, _peak_mb() - before)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"peak_mb": peaks}, f)


def main():
    import subprocess

    import transformers

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(path, max_shard_size="100MB")
    full_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    del model
    here = os.path.abspath(__file__)
    py = sys.executable
    subprocess.run([py, here, "--single", path, os.path.join(tmp, "single.json")], check=True)
    subprocess.run([py, here, "--sharded", path, os.path.join(tmp, "sharded.json")], check=True)
    one = json.load(open(os.path.join(tmp, "single.json")))
    four = json.load(open(os.path.join(tmp, "sharded.json")))
    worst = max(four["peak_mb"])
    print(f"checkpoint: Llama-shaped, {one['params'] / 1e6:.1f} M parameters, {full_mb:.0f} MB fp32, "
          f"safetensors shards of 100 MB")
    print(f"one process (transformers from_pretrained): peak RSS +{one['peak_mb']:.0f} MB")
    print("2x2 (autopar.from_pretrained), per rank:     peak RSS +" +
          ", +".join(f"{m:.0f}" for m in four["peak_mb"]) + " MB")
    print(f"worst rank / one process: {worst / one['peak_mb']:.2f}; goal per rank: "
          f"<= full/p + 300 MB = {full_mb / 4 + 300:.0f} MB")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--single":
        single(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--sharded":
        from autopar.launch import spawn

        spawn(sharded, 4, sys.argv[2], sys.argv[3])
    else:
        main()
