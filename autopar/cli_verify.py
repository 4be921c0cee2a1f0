"""`autopar verify MODEL --grid RxC`: run `autopar.verify` on local gloo processes (or, under torchrun,
on torchrun's ranks) and print its report; the exit status is 0 when every value matches, 1 otherwise.

    python -m autopar verify llama --grid 2x2 --steps 2 --set num_hidden_layers=2 --set hidden_size=64 \
        --set intermediate_size=128 --set num_attention_heads=4 --set num_key_value_heads=2 --set vocab_size=256
    python -m autopar verify mypkg.models:build --grid 1x4 --strategy 1d

MODEL is a transformers model type (its config class with the class defaults plus `--set` overrides,
random weights, every dropout probability set to 0, input_ids and labels of --batch x --seq random
tokens) or `module:callable` returning (model, example_inputs) or (model, example_inputs,
example_kwargs), whose output carries its loss.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile


def add_arguments(sub) -> None:
    """The command's flags (no torch import: `--help` stays quick)."""
    from autopar.cli_common import option_flag, parse_grid

    p = sub.add_parser("verify", help="run a model parallelized and on one process and compare every value")
    p.add_argument("model", help="a transformers model type (gpt2, llama, ...) or module:callable")
    p.add_argument("--grid", default=(2, 2), type=parse_grid, metavar="RxC", help="the grid (default 2x2)")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas of the grid (default 1)")
    p.add_argument("--steps", type=int, default=1, help="training steps to compare (default 1)")
    p.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (a JSON value, else a string); repeatable")
    p.add_argument("--nodes", choices=["always"], help="compare every graph node on a clean run too")
    for name in ("strategy", "lowering", "data_parallel", "recompute"):
        option_flag(p, name, "as parallelize's")
    p.add_argument("--compile", action="store_true", help="run the parallel program under torch.compile")
    p.add_argument("--pipeline", type=int, metavar="S", help="S pipeline stages of the grid each (world S*R*C)")
    p.add_argument("--microbatches", type=int, help="with --pipeline: micro-batches per batch (default S)")


def _model(ns):
    import torch

    from autopar.cli_common import build_callable, build_hf, parse_value

    torch.manual_seed(0)  # the same weights on every rank
    if ":" in ns.model:
        return build_callable(ns.model)
    overrides = dict(kv.split("=", 1) for kv in ns.set)
    overrides = {k: parse_value(v) for k, v in overrides.items()}
    import transformers

    config = transformers.AutoConfig.for_model(ns.model)
    for key, value in config.to_dict().items():  # each block's own dropout masks never equal one process's
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and key not in overrides:
            overrides[key] = 0.0
    model, args, kwargs = build_hf(ns.model, overrides, ns.batch, ns.seq, meta=False)
    if "input_ids" in kwargs:
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, tuple(kwargs["input_ids"].shape), generator=torch.Generator().manual_seed(1))
        kwargs = {**kwargs, "input_ids": ids, "labels": ids}
    return model, args, kwargs


def _worker(rank: int, ns, out: str) -> None:
    import torch

    import autopar

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ns.world)))
    model, args, kwargs = _model(ns)
    grid = (ns.replicas, *ns.grid) if ns.replicas > 1 else ns.grid
    options = {k: getattr(ns, k) for k in ("strategy", "lowering", "data_parallel", "recompute")
               if getattr(ns, k) is not None}
    if ns.pipeline:
        options["pipeline"] = autopar.Pipeline(stages=ns.pipeline, microbatches=ns.microbatches)
    report = autopar.verify(model, args, kwargs, grid=grid, steps=ns.steps, compile=ns.compile,
                            nodes=ns.nodes or True, **options)
    if rank == 0:
        print(report, flush=True)
    with open(f"{out}-{rank}", "w") as f:
        json.dump({"ok": report.ok}, f)


def run(ns) -> int:
    from autopar.launch import run as launch

    ns.world = (ns.pipeline or 1) * ns.replicas * ns.grid[0] * ns.grid[1]
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "verify")
        launch(functools.partial(_worker, ns=ns, out=out), ns.world)
        mine = f"{out}-{os.environ['RANK'] if torchrun else 0}"
        if not os.path.exists(mine):
            print("autopar verify: no report was written (a rank failed; see above)", file=sys.stderr)
            return 2
        with open(mine) as f:
            return 0 if json.load(f)["ok"] else 1
