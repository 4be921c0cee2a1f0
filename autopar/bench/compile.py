"""`python -m autopar.bench.compile`: how long the first compiled call of the benchmark Llama
(`autopar.bench`'s model) takes at 2x2 with `compile=True`, on 4 ranks of this host.

Each configuration runs twice in fresh processes that share one fresh inductor cache directory
(TORCHINDUCTOR_CACHE_DIR): "cold" (an empty cache: a first job) and "warm" (the cache the cold run
left: a restarted job). Printed per run: the slowest rank's first forward + backward (compile
included), its second one (no compile), and what inductor's FX graph cache made of the graphs (hits,
misses, bypasses, summed over ranks). `--compare` also runs the same without the FX graph cache
entry autopar passes (`passes.compat.CACHEABLE_EFFECTS`), as autopar compiled before it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def worker(rank, world, port, cacheable, out):
    import torch.distributed as dist

    import autopar
    import autopar.parallel.run
    from autopar.bench import common
    from autopar.launch import close, init_local
    from passes.compat import fx_graph_cache_counts

    init_local(rank, world, port)
    if not cacheable:  # what compile=True passed to torch.compile before: every graph bypasses the cache
        autopar.parallel.run.INDUCTOR_OPTIONS = {}  # type: ignore[attr-defined]
    model = autopar.parallelize(common.model(), grid=(2, 2), example_kwargs=common.batch(0), compile=True)
    dist.barrier()
    times = []
    for step in range(2):
        t0 = time.perf_counter()
        model(**common.batch(step)).loss.backward()
        times.append(time.perf_counter() - t0)
    cache = fx_graph_cache_counts()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"first_s": times[0], "next_s": times[1], "cache": cache})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    close()


def measure(cacheable: bool) -> list:
    """[cold ranks, warm ranks]: each rank's figures from two runs of fresh processes on one new cache."""
    from autopar.bench import common

    runs = []
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # the children inherit it
        try:
            for _ in range(2):
                out = os.path.join(tmp, "ranks.json")
                common.spawn(worker, 4, cacheable, out)
                with open(out) as f:
                    runs.append(json.load(f))
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    return runs


def line(name: str, state: str, ranks: list) -> str:
    cache = {k: sum(r["cache"].get(k, 0) for r in ranks) for k in ("hit", "miss", "bypass")}
    return (f"| {name} | {state} | {max(r['first_s'] for r in ranks):.1f} s | "
            f"{max(r['next_s'] for r in ranks):.2f} s | {cache['hit']} / {cache['miss']} / {cache['bypass']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.bench.compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", action="store_true",
                        help="also run without the FX graph cache entry (autopar's graphs bypass the cache)")
    ns = parser.parse_args(argv)
    configs = [("graphs cacheable (now)", True)] + ([("graphs bypass the cache (before)", False)] if ns.compare else [])
    print("| configuration | cache | first call | second call | FX graph cache hit / miss / bypass |")
    print("|---|---|---|---|---|")
    for name, cacheable in configs:
        for state, ranks in zip(("cold", "warm"), measure(cacheable)):
            print(line(name, state, ranks), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
