"""Sweep transformers families (examples/hf_families.py) through autopar on a grid of gloo ranks.

For each family: the unmodified model on one process against `autopar.parallelize(model, grid,
example_kwargs=...)` on every rank of one long-lived pool: every output tensor (logits, encoder
states, router logits), the losses, and every parameter gradient by name, element-wise on every rank
with tests/compare.py (`excess` <= 1 at rtol 1e-4 and atol 1e-5 x the largest reference value of
the group: outputs, losses, gradients). Also the ops that fell back to running whole, and the
parameter bytes the fullest rank holds against an even 1/p share. One family's failure (an
exception, a hang past the time budget) is recorded and the sweep goes on.

    .venv/bin/python examples/sweep_hf.py --out docs/models.md           # all, plus 1x4 and auto rows
    .venv/bin/python examples/sweep_hf.py --families gpt2,bloom --grid 1x4 --strategy auto
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import autopar  # noqa: E402
import hf_families  # noqa: E402
from passes import CaptureError, ShardingError  # noqa: E402
from tests.compare import failures, group_excess  # noqa: E402

RTOL, ATOL_FRAC = 1e-4, 1e-5
BATCH, SEQ = 4, 8
EXTRAS = [(f, (1, 4), "2d") for f in ("gpt2", "llama", "bert", "t5", "mixtral")] + \
         [(f, (2, 2), "auto") for f in ("gpt2", "llama", "bert", "t5", "qwen2_moe")]


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    hint = next((ln for ln in lines[1:] if ln.startswith("Both ranks hold the same ops")), None)
    if hint:  # the first line only says where the plans part; the hint says why
        first = f"{first.split(':')[0]}: {hint}"
    # source paths relative to site-packages: the same text on every machine
    return re.sub(r'File "[^"]*site-packages/', 'File "', f"{type(e).__name__}: {first}")


def _tensors(out) -> dict:
    """name -> tensor for every tensor of a ModelOutput, tuples (router logits) flattened."""
    flat = {}
    for k, v in out.items():
        if isinstance(v, (tuple, list)):
            flat.update({f"{k}[{i}]": t for i, t in enumerate(v) if isinstance(t, torch.Tensor)})
        elif isinstance(v, torch.Tensor):
            flat[k] = v
    return flat


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(ref, want, pm, got) -> dict:
    """{tensor name: excess} for outputs, losses and every gradient (a missing one counts as inf)."""
    w_out, g_out = _tensors(want), _tensors(got)
    errs = {f"output {k} (missing in the parallel output)": float("inf") for k in w_out if k not in g_out}
    pairs = {k: (_full(g_out[k]), w) for k, w in w_out.items() if k in g_out}
    losses = {k: v for k, v in pairs.items() if k.endswith("loss")}
    errs.update(group_excess(losses, RTOL, ATOL_FRAC, "output "))
    errs.update(group_excess({k: v for k, v in pairs.items() if k not in losses}, RTOL, ATOL_FRAC, "output "))
    mine = dict(pm.named_parameters())
    grads = {}
    for n, p in ref.named_parameters():
        if n not in mine:
            errs[f"grad {n} (no such parameter in the parallel model)"] = float("inf")
        elif p.grad is not None or mine[n].grad is not None:
            # a gradient that never arrived is zero to an optimizer step on this parameter
            g = mine[n].grad
            grads[n] = (_full(g) if g is not None else torch.zeros(p.shape),
                        p.grad if p.grad is not None else torch.zeros_like(p))
    errs.update(group_excess(grads, RTOL, ATOL_FRAC, "grad "))
    return errs


def family_parity(rank, name, grid=(2, 2), strategy="2d", batch=BATCH, seq=SEQ) -> dict:
    """On every rank: build the family, run it whole and parallelized, compare. Errors come back as
    data (with the stage they happened in) so that the sweep goes on."""
    res = {"errs": {}, "error": None, "refused": False, "stage": "build", "gathered": [], "free": 0,
           "warnings": 0, "held": 0, "total": 0}
    try:
        torch.manual_seed(0)
        model, make = hf_families.build(name)
        model.eval()  # dropout off: one process and the grid then compute the same function
        ref = copy.deepcopy(model)
        kw = make(batch, seq, 1)
        res["stage"] = "reference"
        want = ref(**kw)
        want.loss.backward()
        res["stage"] = "parallelize"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = autopar.parallelize(model, grid=grid, example_kwargs=kw, strategy=strategy)
        res["warnings"] = sum(issubclass(w.category, autopar.FallbackWarning) for w in caught)
        comp = pm.program
        res["gathered"] = [str(f.node.target).replace("aten.", "") for f in comp.fallbacks if f.costly]
        res["free"] = sum(not f.costly for f in comp.fallbacks)
        res["held"] = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
        res["total"] = sum(p.numel() * p.element_size() for p in pm.parameters())
        res["stage"] = "forward"
        got = pm(**kw)
        res["stage"] = "backward"
        got.loss.backward()
        res["stage"] = "compare"
        res["errs"] = compare(ref, want, pm, got)
    except Exception as e:  # reported per family; the sweep goes on
        res["error"] = _first_line(e)
        # autopar's own refusals, with a named reason: no capture, no split, or ranks whose plans differ
        res["refused"] = isinstance(e, (CaptureError, ShardingError)) or "ranks built different plans" in str(e)
    return res


@dataclass
class Row:
    family: str
    grid: tuple
    strategy: str
    status: str  # match | MISMATCH | refused | error
    worst: float = float("nan")  # largest excess over tensors and ranks
    gathered: int = 0  # fallbacks that gather split inputs (what FallbackWarning lists)
    free: int = 0  # fallbacks on inputs already whole (mask and position-id construction)
    fraction: float = float("nan")  # max over ranks of parameter bytes held / (total / p)
    seconds: float = 0.0
    reason: str = ""


def summarize(name, grid, strategy, per_rank) -> Row:
    p = grid[0] * grid[1]
    row = Row(name, grid, strategy, "match")
    r0 = per_rank[0]
    row.gathered, row.free = len(r0["gathered"]), r0["free"]
    if r0["total"]:
        row.fraction = max(r["held"] for r in per_rank) / (r0["total"] / p)
    broken = [(rank, r) for rank, r in enumerate(per_rank) if r["error"]]
    if broken:
        rank, r = broken[0]
        row.status = "refused" if r["refused"] else "error"
        row.reason = f"{r['stage']} (rank {rank}): {r['error']}"
        return row
    errs = [r["errs"] for r in per_rank]
    row.worst = max((v for e in errs for v in e.values()), default=0.0)
    bad = failures(errs)
    if bad:
        row.status = "MISMATCH"
        (rank, tensor), v = max(bad.items(), key=lambda kv: kv[1] if isinstance(kv[1], float) else float("inf"))
        tensors = sorted({t for _, t in bad})
        row.reason = (f"worst {tensor} on rank {rank}: excess {v:.3g}; {len(tensors)} tensor(s) off "
                      f"on {len({r for r, _ in bad})} rank(s): {', '.join(tensors[:4])}"
                      + (" ..." if len(tensors) > 4 else ""))
    if r0["gathered"]:
        ops = sorted(set(r0["gathered"]), key=r0["gathered"].index)
        note = "gathered whole: " + ", ".join(f"{o} x{r0['gathered'].count(o)}" for o in ops)
        row.reason = f"{row.reason}; {note}" if row.reason else note
    return row


def _cell(text: str, width: int = 140) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def table(rows) -> str:
    head = ("| family | kind | grid | strategy | parity | worst excess | fallbacks gathered / free "
            "| params per rank (x 1/p) | time (s) | reason / note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fam = hf_families.FAMILIES[r.family]
        worst = f"{r.worst:.3g}" if r.worst == r.worst else ""
        frac = f"{r.fraction:.2f}" if r.fraction == r.fraction else ""
        lines.append(f"| {r.family} | {fam.kind} | {r.grid[0]}x{r.grid[1]} | {r.strategy} | {r.status} | {worst} | "
                     f"{r.gathered} / {r.free} | {frac} | {r.seconds:.0f} | {_cell(r.reason)} |")
    return "\n".join(lines)


def source_version() -> str:
    """The commit the engine came from, and whether autopar/ or passes/ differed from it."""
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "source: not a git checkout"
    dirty = git("status", "--porcelain", "--", "autopar", "passes")
    return f"commit {commit}" + (" with uncommitted changes in autopar/ or passes/" if dirty else "")


def document(rows, command: str, started: str) -> str:
    import transformers

    counts = {s: sum(r.status == s for r in rows) for s in ("match", "MISMATCH", "refused", "error")}
    details = [f"- **{r.family}** ({r.grid[0]}x{r.grid[1]}, {r.strategy}): {r.reason}"
               for r in rows if r.status != "match"]
    exercised = [f"- **{n}** (`{f.model}`): {f.why}" for n, f in hf_families.FAMILIES.items()
                 if any(r.family == n for r in rows)]
    return "\n".join([
        "# transformers families under autopar",
        "",
        f"Produced by `{command}` (`make sweep-hf`), started {started}, {source_version()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}, gloo on CPU "
        f"({os.cpu_count()} cores).",
        "",
        "Each family is built from its config class at a tiny size (hidden 32, 2 layers, 4 heads, vocabulary 64; "
        "see `examples/hf_families.py`), in eval mode, with one call's inputs (batch 4, sequence 8, labels, one "
        "padded sequence). Parity: the unmodified model on one process against `autopar.parallelize` on every "
        "rank: every output tensor, the losses and every parameter gradient by name, element-wise with "
        f"`tests/compare.py` (`excess` <= 1 at rtol {RTOL:g}, atol {ATOL_FRAC:g} x the largest reference "
        "value of the group). *worst excess* is the largest over tensors and ranks. *fallbacks*: ops run whole "
        "on every rank that gather split inputs / that only see whole inputs (free). *params per rank*: the "
        "fullest rank's parameter bytes over an even 1/p share (1.00 = perfectly split).",
        "",
        f"Result: {counts['match']} match, {counts['MISMATCH']} MISMATCH, {counts['refused']} refused, "
        f"{counts['error']} error, of {len(rows)} runs.",
        "",
        table(rows),
        "",
        "## Not matching or refused: first error line / worst tensor",
        "",
        *(details or ["(none)"]),
        "",
        "## What each family exercises",
        "",
        *exercised,
        "",
    ])


def _grid(text: str) -> tuple:
    try:
        r, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid {text!r}: expected RxC, e.g. 2x2 or 1x4") from None
    return r, c


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated names (default: all in hf_families)")
    ap.add_argument("--grid", type=_grid, default=(2, 2), help="RxC, e.g. 2x2 (default) or 1x4")
    ap.add_argument("--strategy", default="2d", choices=["2d", "1d", "auto"])
    ap.add_argument("--out", default="", help="write the markdown report here (rewritten after each family)")
    ap.add_argument("--budget", type=float, default=600, help="seconds per family before it counts as a hang")
    ap.add_argument("--extras", action=argparse.BooleanOptionalAction, default=None,
                    help="also run the 1x4 and strategy='auto' rows (default: on when --families is not given)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.families.split(",") if n.strip()] or list(hf_families.FAMILIES)
    unknown = [n for n in names if n not in hf_families.FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {unknown}; expected names from {', '.join(hf_families.FAMILIES)}")
    runs = [(n, args.grid, args.strategy) for n in names]
    if args.extras or (args.extras is None and not args.families):
        runs += EXTRAS
    return args, runs


def ready(rank) -> int:
    """A rank-side no-op: answers once the rank has joined the process group."""
    return rank


def _start_pool(Pool, world: int, probe, tries: int = 3):
    """A pool whose ranks all answer; a start that fails (a port taken by another process between
    choosing and binding it) is retried, so that it is not blamed on the next family."""
    for _ in range(tries):
        pool = Pool(world)
        try:
            pool.run(probe, timeout=600)
            return pool
        except AssertionError as e:
            print(f"pool of {world} ranks failed to start ({_first_line(e)}); retrying", flush=True)
    raise RuntimeError(f"could not start {world} gloo ranks in {tries} tries; see the errors above")


def main(argv=None):
    from sweep_hf import family_parity as check, ready  # importable by name in the spawned ranks
    from tests.dist_pool import Pool

    args, runs = parse(argv)
    command = "python examples/sweep_hf.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    pool, rows = None, []
    try:
        for name, grid, strategy in runs:
            world = grid[0] * grid[1]
            if pool is None or pool.broken or pool.world != world:
                if pool is not None:
                    pool.close()
                pool = _start_pool(Pool, world, ready)
            t0 = time.perf_counter()
            try:
                row = summarize(name, grid, strategy, pool.run(check, name, grid, strategy, timeout=args.budget))
            except AssertionError as e:  # a hang past the budget or a dead rank: the pool was torn down
                row = Row(name, grid, strategy, "error", reason=_first_line(e))
            row.seconds = time.perf_counter() - t0
            rows.append(row)
            print(f"{name:22s} {grid[0]}x{grid[1]} {strategy:4s} {row.status:8s} {row.seconds:6.1f}s "
                  f"{row.reason[:150]}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(document(rows, command, started))
    finally:
        if pool is not None:
            pool.close()
    print()
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
