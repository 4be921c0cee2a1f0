"""`python -m autopar inspect MODEL ...` (also the `autopar` console script): plan a model on a grid
without the hardware and print what it costs.

MODEL is a transformers model type (`gpt2`, `llama`, `bert`, `t5`, `vit`, ...: its config class with
the class defaults plus `--set key=value` overrides; nothing is downloaded, weights live on the meta
device) or `module:callable` returning (model, example_inputs) or (model, example_inputs,
example_kwargs).
"""

from __future__ import annotations

import argparse
import json
import sys

from autopar.cli_common import build_callable, build_hf, option_flag, parse_grid, parse_value

# torch, transformers and autopar's modules are imported where a command needs them: `--help` and
# argument errors answer in a fraction of a second instead of the seconds importing torch takes


def _inspect_grid(text: str):
    """inspect's --grid: RxC, DxRxC (D data-parallel replicas of an RxC grid), or 'auto'."""
    if text == "auto":
        return text
    if text.lower().count("x") == 2:
        d, rest = text.lower().split("x", 1)
        if not d.isdigit() or int(d) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: expected DxRxC with D replicas >= 1, e.g. 2x2x2")
        return (int(d), *parse_grid(rest))
    return parse_grid(text)


def _stages(text: str):
    """inspect's --pipeline: a stage count >= 2, or 'auto' (choose_pipeline)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of stages >= 2, or auto")
    return int(text)


def calibrate_grid(parser, words: list) -> tuple:
    """calibrate's --grid: RxC like inspect's, or the two numbers `R C` it took before."""
    if len(words) == 2 and all(w.isdigit() for w in words):
        words = ["x".join(words)]
    if len(words) != 1:
        parser.error(f"argument --grid: {' '.join(words)!r}: expected RxC, e.g. 2x2 or 1x4")
    try:
        return parse_grid(words[0])
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --grid: {e}")


def _layers_hidden(model, pl) -> tuple:
    """From the model's config where it has one (transformers' names), else from the captured graph's
    parameters (a plain nn.Module: `autopar.planning.plan.layers_and_hidden`)."""
    from autopar.planning.plan import layers_and_hidden

    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or getattr(cfg, "num_layers", 0)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or getattr(cfg, "d_model", 0)
    if isinstance(layers, int) and isinstance(hidden, int) and layers and hidden:
        return layers, hidden
    return layers_and_hidden(pl)


def _tokens(args, kwargs, hidden: int) -> int:
    """The tokens of a module:callable's example batch (its first tensor input: ids [B, S] hold B*S,
    activations [B, S, hidden] hold B*S), not --batch x --seq, which only size transformers models."""
    import torch

    first = next((t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)), None)
    if first is None:
        return 0
    return first.numel() // hidden if first.dim() > 1 and hidden and first.shape[-1] == hidden else first.numel()


def inspect_cmd(ns) -> int:
    from autopar.cli_inspect import choose_pipeline_cmd, dry_run_cmd, pipeline_cmd
    from autopar.planning.explain import arrangement_lines
    from autopar.planning.grids import replica_inputs
    from autopar.planning.report import dot, group_by_module, html, plot, require_matplotlib, sweep_table

    if ns.plot:  # before torch loads and the minutes of planning
        require_matplotlib("autopar inspect --plot")
    import autopar

    overrides = dict(kv.split("=", 1) for kv in ns.set)
    overrides = {k: parse_value(v) for k, v in overrides.items()}
    if ns.max_batch:
        return max_batch_cmd(ns, overrides)
    if ":" in ns.model:
        model, args, kwargs = build_callable(ns.model)
    else:
        model, args, kwargs = build_hf(ns.model, overrides, ns.batch, ns.seq)
    limit = ns.memory_limit
    strategy = ns.strategy or ("auto" if ns.grid == "auto" else "2d")
    grids = None
    if ns.pipeline == "auto":
        return choose_pipeline_cmd(ns, model, kwargs, limit, args)
    if ns.grid == "auto":
        if not ns.devices:
            raise SystemExit("autopar inspect: --grid auto needs --devices N (how many ranks to arrange)")
        arranged = autopar.choose_grid(model, ns.devices, args, kwargs, cost_model=ns.cost_model, memory_limit=limit)
        grid, grids = arranged.kwargs["grid"], arranged.to_json()  # the cube's per-unit mix: by the device count
        if arranged.layout == "replicas":  # each replica computes its share of the batch
            args, kwargs = replica_inputs(args, kwargs, arranged.grid[0])
    else:
        grid = ns.grid
    if ns.pipeline:
        return pipeline_cmd(ns, model, grid, args, kwargs, strategy, limit)
    if ns.dry_run:
        return dry_run_cmd(ns, model, grid, args, kwargs, strategy, limit)
    pl = autopar.plan(model, grid=grid, example_inputs=args, example_kwargs=kwargs, strategy=strategy,
                      cost_model=ns.cost_model, memory_limit=limit, recompute=ns.recompute,
                      data_parallel=ns.data_parallel, reshard_after_forward=ns.reshard_after_forward)
    layers, hidden = _layers_hidden(model, pl)
    tokens = ns.batch * ns.seq if ":" not in ns.model else _tokens(args, kwargs, hidden)
    report = pl.to_json()
    if grids is not None:
        report["grid_search"] = grids
    if pl.choice is not None:
        c = pl.choice
        report["strategy_auto"] = {"assignment": c.assignment, "estimated_step_s": c.estimate.time_s,
                                   "fixed_2d_step_s": c.baselines["2d"].time_s,
                                   "fixed_1d_step_s": c.baselines["1d"].time_s,
                                   "memory_estimate_bytes": c.estimate.memory_bytes, "alternatives_s": c.alternatives,
                                   "evaluated": c.evaluated, "solve_s": c.solve_s,
                                   "recompute_blocks": list(c.recompute_blocks)}
    if ns.vs == "1d":
        report["vs_1d"] = autopar.compare_1d(pl, model, tokens, layers, hidden)
    if ns.sweep or ns.plot:
        report["sweep"] = sweep_table(model, args, kwargs, ns.sweep or 64, tokens, layers, hidden)
    if ns.plot:
        plot(report["sweep"], ns.plot)
    if ns.dot:
        with open(ns.dot, "w") as f:
            f.write(html(pl) if ns.dot.endswith(".html") else dot(pl))
    if ns.json:
        report.pop("nodes")
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(group_by_module(pl))
    if pl.comm_bytes_most != pl.comm_bytes_per_rank_per_step:
        print(f"bytes received differ by grid position (torch.chunk blocks of unequal sizes): the table prices "
              f"(0, 0), {pl.comm_bytes_per_rank_per_step / 2**30:.2f} GiB per step; the most, "
              f"{pl.comm_bytes_most / 2**30:.2f} GiB, at {pl.comm_bytes_most_at}")
    for line in arrangement_lines(grids or []):
        print(line)
    if ns.recompute or pl.recompute_bytes:
        print(f"recomputation: {pl.recompute_bytes / 2**20:.1f} MiB received again per rank per step; saved for "
              f"backward {(pl.activation_bytes or 0) / 2**20:.1f} MiB per rank")
    if pl.choice is not None:
        from autopar.planning.explain import strategy_summary

        print("\n".join(strategy_summary(pl.choice)))
    if "vs_1d" in report:
        v = report["vs_1d"]
        print(f"\n1D (Megatron-style) at p={v['p']}: {v['comm_bytes_per_rank_per_step'] / 2**20:.1f} MiB received per "
              f"rank per step, {v['param_bytes_per_rank'] / 2**20:.1f} MiB parameters per rank; 2D/1D: bytes "
              f"{v['ratio_2d_over_1d_comm']:.2f}, parameters {v['ratio_2d_over_1d_params']:.2f}")
    for row in report.get("sweep", []):
        print(row)
    return 0


def max_batch_cmd(ns, overrides: dict) -> int:
    """`inspect MODEL --max-batch --memory-limit SIZE --grid RxC`: the largest batch per scheme (2D, 1D,
    1D x data parallel, auto), without and with recomputation (`autopar.planning.capacity`)."""
    if ":" in ns.model:
        raise SystemExit("autopar inspect --max-batch: needs a transformers model type (it builds the model at "
                         "several batch sizes), not module:callable")
    if not ns.memory_limit or ns.grid == "auto":
        raise SystemExit("autopar inspect --max-batch: needs --memory-limit SIZE and --grid RxC (e.g. --grid 8x8 "
                         "--memory-limit 80GiB)")
    from autopar.planning.capacity import max_batch, ratio, table
    from passes.options import format_bytes

    limit = ns.memory_limit
    rows = max_batch(lambda b: build_hf(ns.model, overrides, b, ns.seq), ns.grid, limit, cost_model=ns.cost_model)
    if ns.json:
        print(json.dumps([{**c.__dict__, "grid": list(c.grid)} for c in rows], indent=2))
        return 0
    print(f"{ns.model}, sequences of {ns.seq} tokens, {format_bytes(limit)} per device, "
          f"{ns.grid[0] * ns.grid[1]} devices")
    print(table(rows, limit))
    for rc in (False, True):
        r1, rdp = ratio(rows, "2d", "1d", rc), ratio(rows, "2d", "1d x dp", rc)
        print(f"2d / 1d{' (recompute)' if rc else ''}: " + (f"{r1:.1f}x" if r1 else "1d fits no batch")
              + "; 2d / 1d x dp: " + (f"{rdp:.1f}x" if rdp else "1d x dp fits no batch"))
    return 0


def calibrate_cmd(ns) -> int:
    """`autopar calibrate`: measure alpha, beta per mesh axis and the matmul rate, write them as JSON.
    Under torchrun (RANK, WORLD_SIZE set) this process joins torchrun's group (nccl when it has a GPU);
    otherwise it spawns R*C local gloo processes."""
    import functools
    import os

    import torch

    from autopar.errors import UsageError
    from autopar.planning.calibrate import SIZES, check_args, main_worker, model_shapes, parse_shapes
    from autopar.launch import run

    from passes.cost.cluster import PRESETS

    (R, C), sizes = ns.grid, tuple(ns.sizes or SIZES)
    try:
        check_args(sizes, ns.repeats)
        shapes = parse_shapes(ns.shapes) if ns.shapes else None
        if ns.model:
            shapes = (shapes or ()) + model_shapes(ns.model, ns.seq, ns.batch)
        if ns.cluster is not None and ns.cluster not in PRESETS:
            raise UsageError(f"calibrate --cluster {ns.cluster!r}: expected one of the presets {sorted(PRESETS)}")
    except ValueError as e:
        raise SystemExit(f"autopar {e}") from None
    peak = PRESETS[ns.cluster].peak_flops if ns.cluster else None
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    backend = "nccl" if torchrun and torch.cuda.is_available() else "gloo"
    run(functools.partial(main_worker, grid=(R, C), out_path=ns.out, sizes=sizes, repeats=ns.repeats, dtype=ns.dtype,
                          shapes=shapes, peak_flops=peak), R * C, backend)
    return 0


def bench_cmd(ns) -> int:
    from autopar.planning.report import require_matplotlib

    if ns.plot:  # before torch loads and the minutes of measuring
        require_matplotlib("autopar bench --plot")
    from autopar.bench.compare import run

    return run(ns)


def parse_size(text: str):
    """--memory-limit's value: '80GiB', '500MB' or bytes, as parallelize's memory_limit takes it; a
    usage error naming the flag otherwise (a plain 80 is 80 bytes: it asks whether GiB was meant)."""
    from passes.options import MIN_MEMORY_LIMIT, parse_bytes

    n = parse_bytes(text)
    if n is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 80GiB, 500MB or a number of bytes")
    if n < MIN_MEMORY_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is {n:g} bytes per rank, too little to hold any model: did you "
                                         f"mean {text}GiB?")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="2D tensor parallelism planner")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("bench", help="measure 2D against PyTorch 1D TP and one process (see autopar.bench)")
    from autopar.bench.args import add_bench_arguments

    add_bench_arguments(p)
    p = sub.add_parser("inspect", help="plan a model on a grid and print its costs")
    p.add_argument("model", help="a transformers model type (gpt2, llama, ...) or module:callable")
    p.add_argument("--grid", default=(2, 2), type=_inspect_grid, metavar="RxC",
                   help="the grid, e.g. 8x8 or 2x4 (default 2x2); DxRxC for D data-parallel replicas of it (8x8x8); "
                        "'auto' picks the shape for --devices")
    p.add_argument("--devices", type=int, help="with --grid auto: the number of ranks to arrange")
    option_flag(p, "strategy", "default 2d; auto with --grid auto", default=None)
    option_flag(p, "data_parallel", "with a DxRxC grid")
    p.add_argument("--keep-after-forward", dest="reshard_after_forward", action="store_false",
                   help="with --data-parallel shard: keep each block's gathered parameters from its forward to its "
                        "backward (reshard_after_forward=False: one all-gather per block and step, not two)")
    option_flag(p, "cost_model", "JSON from `autopar calibrate`; default: published NVLink/InfiniBand figures",
                 metavar="FILE")
    option_flag(p, "memory_limit", "a size per rank: 80GiB, 500MB, or bytes; also --max-batch's limit",
                 type=parse_size, metavar="SIZE")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (a JSON value, else a string); repeatable")
    p.add_argument("--vs", choices=["1d"], help="also report Megatron-style 1D at the same p")
    p.add_argument("--sweep", type=int, metavar="N", help="compare all square grids and 1D with p <= N")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    option_flag(p, "recompute", "", help="activation recomputation: 'blocks' (each repeated block run again in "
                 "backward) or 'selective' (the local ops between matmuls recomputed); without the flag, as "
                 "parallelize's default: none unless a memory limit asks")
    p.add_argument("--max-batch", action="store_true",
                   help="the largest batch per scheme (2D, 1D, 1D x data parallel, auto) that fits --memory-limit "
                        "on --grid, without and with recomputation")
    p.add_argument("--pipeline", type=_stages, metavar="S",
                   help="plan S pipeline stages of the grid each; 'auto' with --devices N searches stage counts, "
                        "grids, replicas, schedules and recompute (autopar.choose_pipeline) and prints every layout "
                        "tried (--grid auto alone arranges one stage)")
    p.add_argument("--schedule", default="1f1b", help="with --pipeline: the schedule (default 1f1b)")
    p.add_argument("--microbatches", type=int, help="with --pipeline: micro-batches per batch (default S)")
    p.add_argument("--stages-per-rank", type=int, default=1, help="with --pipeline: stages per pipeline rank")
    p.add_argument("--cluster", help="price axes by the nodes they span: dgx-h100, grand-teton-h100, dgx-a100")
    p.add_argument("--dry-run", nargs="?", const="cover", choices=["cover", "covering", "groups", "all"],
                   metavar="RANKS",
                   help="build and step each simulated rank's program under the fake process group (autopar.dry_run) "
                        "and check its collectives across ranks: 'cover' (default) every row, column and replica "
                        "index once; 'groups' also a whole row, column and replica group; 'all'")
    p.add_argument("--workers", type=int, metavar="N",
                   help="with --dry-run: processes that simulate the ranks side by side on fake tensors (default: "
                        "one per CPU; 1: in this process)")
    p.add_argument("--dot", metavar="FILE", help="write the graph (Graphviz DOT, or HTML for *.html)")
    p.add_argument("--plot", metavar="FILE", help="plot bytes and parameters per rank against p, 2D and 1D "
                                                   "(a sweep up to --sweep or 64; needs matplotlib)")
    from autopar.cli_estimate import add_arguments as add_estimate_arguments

    add_estimate_arguments(sub)
    from autopar.cli_verify import add_arguments as add_verify_arguments

    add_verify_arguments(sub)
    p = sub.add_parser("calibrate", help="measure the alpha-beta communication model and matmul rate here")
    p.add_argument("--grid", nargs="+", required=True, metavar="RxC",
                   help="the grid to measure on, e.g. 2x2 (the older form `--grid 2 2` is read too)")
    p.add_argument("--out", default="autopar-calibration.json", help="where to write the JSON")
    p.add_argument("--sizes", type=int, nargs="+", metavar="BYTES",
                   help="message sizes in bytes, multiples of 4 (default 4096 65536 1048576 4194304)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (median taken)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="the matmuls' dtype (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--shapes", metavar="MxKxN,...", help="products to time (default: one 1024x1024x1024)")
    p.add_argument("--model", help="time the products of this model (config.json, its folder, or a published "
                   "architecture: llama3-8b, ...) on --batch sequences of --seq tokens")
    p.add_argument("--seq", type=int, default=4096, help="with --model: tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="with --model: sequences per product (default 1)")
    p.add_argument("--cluster", help="a preset (dgx-h100, ...) whose dense peak the matmul rate is compared with")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.cmd == "bench":
        return bench_cmd(ns)
    if ns.cmd == "calibrate":
        ns.grid = calibrate_grid(parser, ns.grid)
        return calibrate_cmd(ns)
    if ns.cmd in ("estimate", "plan"):
        from autopar.cli_estimate import run

        return run(ns)
    if ns.cmd == "verify":
        from autopar.cli_verify import run as verify_run

        return verify_run(ns)
    for kv in ns.set:
        if "=" not in kv:
            parser.error(f"--set {kv!r}: expected KEY=VALUE")
    return inspect_cmd(ns)


if __name__ == "__main__":
    sys.exit(main())
