"""`autopar bench`'s flags, apart from the benchmarks so that `autopar bench --help` answers without
loading torch."""


def add_bench_arguments(p) -> None:
    """`autopar bench`'s flags (kept here, away from torch, so `--help` is quick)."""
    p.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="rounds over all configurations, alternated to spread machine noise (default 3)")
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="training steps per configuration per round; the first of round 1 is warm-up (default 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a Markdown table")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (autopar 2x2 and 1x1, "
                   "PyTorch 1D TP compiled), which spend minutes compiling")
    p.add_argument("--plot", metavar="FILE", help="also draw step time, bytes and saved activations per "
                                                  "configuration as bars (needs matplotlib: pip install "
                                                  "'autopar[plot]')")
    p.add_argument("--cost-model", metavar="FILE", help="`autopar calibrate` JSON for strategy='auto' "
                                                        "(default: measured here first, on 2x2)")
    p.add_argument("--generate", action="store_true", help="measure generation instead: prefill and decode "
                   "tokens/s at batch 1 and 8, bytes per decoded token, and the planner's Llama-7B projection "
                   "(see autopar.bench.generate)")
    p.add_argument("--moe", action="store_true", help="measure a Mixtral-style mixture of experts instead: one "
                   "process, autopar 2x2 and 1x4, PyTorch 1D TP with the experts' intermediate dim split "
                   "(see autopar.bench.moe)")
    p.add_argument("--dp", action="store_true", help="measure sharded against replicated replicas instead: the "
                   "benchmark Llama at grid (2, 2, 2) on 8 ranks with data_parallel='replicate' and 'shard' "
                   "(see autopar.bench.dp)")
    p.add_argument("--pipeline", action="store_true", help="measure pipeline stages instead: the benchmark Llama on "
                   "8 ranks as 2 stages of 2x2 (1F1B, breadth-first) against 2x4 (2D) and 1x8 (1D) at the same "
                   "batch (see autopar.bench.pipeline)")
    p.add_argument("--lowerings", action="store_true", help="measure one SUMMA product in each lowering instead "
                   "(broadcast, all-gather, ring) on 2x2 and 3x3: peak temporary memory, bytes, calls, time "
                   "(see autopar.bench.lowerings)")
    p.add_argument("--cube", action="store_true", help="measure 3D tensor parallelism instead: the benchmark Llama "
                   "on 8 ranks as a 2x2x2 cube against 2x4, 4x2 (2D) and 1x8 (1D) (see autopar.bench.cube)")
    p.add_argument("--search", action="store_true", help="time the arrangement search instead: a Llama-7B shape "
                   "at 64 and 512 ranks, with and without replica layouts: the pick, its estimate against the best "
                   "fixed scheme, the search's seconds (see autopar.bench.search)")
    p.add_argument("--dimensions", action="store_true", help="print 1D, 2D and 3D side by side for the linears of "
                   "Llama-7B and -70B shapes at 64 and 512 ranks, from the formulas: bytes, parameters and inputs "
                   "held per rank, ratio to the lower bound (see autopar.bench.dimensions)")
    p.add_argument("--published", action="store_true", help="estimate published, measured training runs "
                   "(torchtitan's Llama 3 H100 and A100 tables) in their own configurations and print estimate "
                   "against measurement; with --plot FILE a scatter plot, --out FILE the JSON "
                   "(see autopar.bench.published)")
    p.add_argument("--out", metavar="FILE", help="with --published: also write the rows as JSON here")
