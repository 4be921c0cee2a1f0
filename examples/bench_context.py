"""Context parallelism at a long sequence: activation memory and bytes per rank against one process.

A Llama-shaped model (hidden 256, 8 query heads of 32, 4 KV heads, 2 layers, vocabulary 1,024) trains one
step at batch 1 and sequence `--seq` (default 16,384) on one process, then with `context_parallel=cp` for
each cp of `--cp` (default 2 4) and each `--attention` flavour (default auto, ring) on a 1x1 grid, cp gloo
ranks, all in this invocation. Per configuration:

- saved MiB: the bytes of the distinct storages autograd saves for backward during the forward (the
  activations a step holds), the largest over the ranks; its ratio to one process's, and that ratio times cp
  (issue 56's bound: at most 1.3);
- bytes: what each rank received in the context-parallel collectives (forward, backward), counted by the
  CommLog, against `passes.cost.context`'s price for the same step;
- step: one forward and backward, seconds (2 cores shared by the ranks: not a speed figure);
- loss: against one process's.

    python examples/bench_context.py [--seq 16384] [--cp 2 4] [--attention auto ring] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 8, 4, 2, 1024


def _model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   max_position_embeddings=65536, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _batch(seq: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    return dict(input_ids=ids, labels=ids)


def _step(call) -> tuple:
    """(saved bytes, loss, seconds) of one forward and backward."""
    storages: dict = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    began = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    out.loss.backward()
    return sum(storages.values()), float(out.loss.detach()), time.perf_counter() - began


def _rank(rank: int, cp: int, seq: int, path: str, attention: str) -> None:
    import autopar
    from passes.cost.context import flavour, loss_bytes, output_bytes, step_bytes

    torch.set_num_threads(1)
    batch = _batch(seq)
    pm = autopar.parallelize(_model(), grid=(1, 1), example_kwargs=batch, context_parallel=cp,
                             context_attention=attention)
    pm.grid.log.reset()
    saved, loss, took = _step(lambda: pm(**batch))
    counted = {ph: sum(v for (t, p), v in pm.grid.log.bytes.items() if t.startswith("context") and p == ph)
               for ph in ("fwd", "bwd")}
    n, d = seq // cp, HIDDEN // HEADS
    kind = flavour(HEADS, KV_HEADS, cp, attention)
    fwd, bwd = step_bytes((1, HEADS, n, d), (1, KV_HEADS, n, d), 4, cp, kind)
    priced = {"fwd": LAYERS * fwd + output_bytes(n * VOCAB * 4, cp) + loss_bytes(4, cp), "bwd": LAYERS * bwd}
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"saved": saved, "loss": loss, "seconds": took, "counted": counted, "priced": priced,
                   "flavour": kind}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--attention", nargs="+", default=["auto", "ring"],
                    help="context_attention values to run at each cp ('auto': all-to-all where the heads divide)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from autopar.launch import spawn

    torch.set_num_threads(2)
    batch = _batch(a.seq)
    saved, loss, took = _step(lambda: _model()(**batch))
    rows = [{"cp": 1, "saved_mib": saved / 2**20, "ratio": 1.0, "ratio_x_cp": 1.0, "loss": loss, "seconds": took}]
    print(f"sequence {a.seq}, batch 1, Llama hidden {HIDDEN}, {HEADS} heads ({KV_HEADS} KV), {LAYERS} layers")
    print(f"{'cp':>3} {'attention':>9} {'saved MiB/rank':>15} {'x one process':>14} {'x cp':>6} "
          f"{'fwd bytes (counted/priced)':>29} "
          f"{'bwd bytes':>23} {'loss diff':>10} {'step s':>7}")
    print(f"{1:>3} {'-':>9} {saved / 2**20:15.1f} {1.0:14.3f} {1.0:6.2f} {'-':>29} {'-':>23} {'-':>10} {took:7.1f}")
    for cp, attention in ((cp, at) for cp in a.cp for at in a.attention):
        path = os.path.join(tempfile.mkdtemp(prefix="autopar-bench-cp-"), "rank")
        spawn(_rank, cp, cp, a.seq, path, attention)
        ranks = [json.load(open(f"{path}.{r}")) for r in range(cp)]
        worst = max(r["saved"] for r in ranks)
        ok = all(r["counted"] == r["priced"] for r in ranks)
        r0 = ranks[0]
        row = {"cp": cp, "saved_mib": worst / 2**20, "ratio": worst / saved, "ratio_x_cp": worst / saved * cp,
               "counted": r0["counted"], "priced": r0["priced"], "bytes_equal_every_rank": ok,
               "loss_diff": max(abs(r["loss"] - loss) for r in ranks), "seconds": max(r["seconds"] for r in ranks),
               "flavour": r0["flavour"]}
        rows.append(row)
        fb = f"{r0['counted']['fwd']}/{r0['priced']['fwd']}"
        bb = f"{r0['counted']['bwd']}/{r0['priced']['bwd']}"
        print(f"{cp:>3} {r0['flavour']:>9} {row['saved_mib']:15.1f} {row['ratio']:14.3f} {row['ratio_x_cp']:6.2f} "
              f"{fb:>29} {bb:>23} "
              f"{row['loss_diff']:10.1e} {row['seconds']:7.1f}" + ("" if ok else "  (bytes differ on some rank)"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seq": a.seq, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
