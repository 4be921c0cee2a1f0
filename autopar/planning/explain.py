"""`explain`: what the compiler did to a model, as a table a person can read.

One row per op of the per-rank graph: its name, the aten op or inserted module, the user's module
path, the layout of its result, the collectives it runs and the bytes each rank receives for them
in the forward and the backward of one training step. By default only the ops that move bytes or
fell back to replication are listed (`verbose=True`: every op). A summary follows: bytes per step,
parameter bytes held by this rank against the whole model, and every op that fell back.
"""

from __future__ import annotations

from dataclasses import dataclass


from autopar.errors import UsageError
from autopar.planning.grids import describe
from autopar.program import uneven as uneven
from passes.cost.context import FLAVOURS, step_bytes
from passes.cost.pipeline import bubble
from passes.cost.planned import node_calls, node_cost, nodes_needing_grad
from passes.cost.model import CostModel
from passes.kernels.spec import Site, SummaSpec, flops
from passes.search.estimate import double_buffered, hidden_dw_reduction
from passes.meta import CHOICE_WHY, INSERTED, KERNEL, LAYOUT, RECOMPUTE, STRATEGY
from passes.nodes import module_path
from passes.ops.context import ContextAttention


@dataclass
class Row:
    node: str
    op: str
    module: str
    layout: str
    collectives: str
    fwd_bytes: int
    bwd_bytes: int
    note: str
    formula: str = ""  # the bytes as sympy expressions, with the values substituted
    flops: int = 0  # forward + backward FLOPs on this rank (matmul-like ops)
    fallback: bool = False  # the op fell back to replication (runs whole on every rank)
    recompute_bytes: int = 0  # recompute=...: forward bytes received again when backward recomputes the op
    calls_fwd: int = 0  # collective calls this rank launches for the op, forward
    calls_bwd: int = 0  # and backward


def _op_name(gm, node) -> str:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        extra = mod.extra_repr()
        return f"{type(mod).__name__}({extra})" if extra else type(mod).__name__
    return str(node.target).replace("aten.", "").replace(".default", "")


def _why(node) -> str:
    """strategy='auto': the option chosen for this node's unit against the alternatives, as the best
    estimated step time with the unit forced to each."""
    why = node.meta.get(CHOICE_WHY)
    if not why:
        return ""
    chosen, alts = why
    others = ", ".join(f"{o} {t * 1e3:.2f}" if t is not None else f"{o} n/a" for o, t in alts.items() if o != chosen)
    return f" [auto: {chosen}, est. {alts[chosen] * 1e3:.2f} ms/step; {others}]"


def strategy_summary(choice) -> list:
    """Footer lines for a model compiled with strategy='auto'."""
    est, base = choice.estimate, choice.baselines
    return [
        f"strategy auto: estimated step {est.time_s * 1e3:.2f} ms (fixed 2d {base['2d'].time_s * 1e3:.2f} ms, "
        f"fixed 1d {base['1d'].time_s * 1e3:.2f} ms); memory estimate {est.memory_bytes / 2**20:.1f} MiB/rank; "
        f"{choice.evaluated} assignments in {choice.solve_s:.2f} s"
        + ("" if getattr(choice, "complete", True) else " (search stopped at its time budget: best found so far)"),
        "  " + "; ".join(f"{k}: {v}" for k, v in choice.assignment.items()),
    ] + ([f"  recomputes {len(choice.recompute_blocks)} blocks in backward to fit memory_limit: "
          + ", ".join(choice.recompute_blocks)] if getattr(choice, "recompute_blocks", ()) else [])


def rows(pmodel) -> list:
    """The table's rows for the graph of the model's most recent call (or its first compile)."""
    comp = pmodel.program
    return graph_rows(comp.inspected, pmodel.grid.shape)


def graph_rows(gm, mesh, at: tuple = (0, 0)) -> list:
    """One Row per op of a compiled per-rank graph on an R x C `mesh` ((R, C), or q for q x q), priced
    at grid position `at` (where torch.chunk blocks differ per rank; (0, 0) holds the largest)."""
    out = []
    grads = nodes_needing_grad(gm)
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        cost = node_cost(gm, node, mesh, grads, at)
        calls = node_calls(gm, node, mesh, grads, at)
        strat = node.meta.get(STRATEGY)
        own = strat is not None and not node.meta.get(INSERTED)  # the strategy is this op's
        lay = node.meta.get(LAYOUT)
        out.append(Row(
            node=node.name,
            op=_op_name(gm, node),
            module=module_path(node),
            layout=repr(lay) if lay is not None else "",
            collectives=cost.collectives if cost else "",
            fwd_bytes=cost.fwd if cost else 0,
            bwd_bytes=cost.bwd if cost else 0,
            note=strat.note + _why(node) if own else "",
            formula=cost.formula if cost else "",
            flops=flops(Site.inserted(node, mesh, grads, at), node.meta.get(KERNEL)),
            fallback=own and strat.fallback,
            recompute_bytes=cost.fwd if cost and node.meta.get(RECOMPUTE) else 0,
            calls_fwd=calls[0],
            calls_bwd=calls[1],
        ))
    return out


def collectives_line(pmodel, every: list) -> str:
    """Collective calls each rank launches per training step (what `CommLog.calls` counts), and with
    data-parallel replicas the gradient all-reduces over them (one per bucket, `pmodel.grad_bucket_plan`)."""
    fwd, bwd = sum(r.calls_fwd for r in every), sum(r.calls_bwd for r in every)
    again = sum(r.calls_fwd for r in every if r.recompute_bytes)  # recompute=...: forward calls made again
    line = f"collectives per rank per step: {fwd + bwd + again} (forward {fwd}, backward {bwd}"
    line += f", recomputed {again})" if again else ")"
    t = pmodel.replica_traffic()
    if t is not None:
        line += (f"; plus FSDP2 over the {pmodel.grid.dp} replicas (data_parallel='shard'): {t.calls} calls in "
                 f"{t.units} units (the root and each repeated block), all-gathers of the parameters "
                 f"({_fmt_bytes(t.gather_bytes)} received) and reduce-scatters of the gradients "
                 f"({_fmt_bytes(t.scatter_bytes)}); at most {_fmt_bytes(t.gathered_bytes)} of parameters gathered "
                 f"at once")
    elif pmodel.grid.dp > 1:
        plan = pmodel.grad_bucket_plan()
        cap = pmodel.options.grad_bucket_mb
        line += (f"; plus {len(plan.buckets)} data-parallel gradient all-reduces over the {pmodel.grid.dp} "
                 f"replicas ({len(plan.keys)} parameter blocks in buckets of <= {cap:g} MiB, "
                 f"{_fmt_bytes(plan.received(pmodel.grid.dp))} received)")
    return line


def overlap_line(pmodel, gm) -> str | None:
    """What the `overlap` option runs and what the cost model says it hides: for the SUMMA products of `gm`,
    their transfers' estimated seconds per step, the share behind matmuls (every panel's but each product's
    first in the broadcast and ring lowerings, the weight gradient's reduction behind the input gradient's
    product in the all-gather one) and the rest exposed. None without SUMMA products."""
    grid = pmodel.grid
    cm = CostModel.resolve(pmodel.options.cost_model)
    on = grid.prefetch
    grads, mesh = nodes_needing_grad(gm), grid.shape
    total = hidden = 0.0
    products = 0
    for node in gm.graph.nodes:
        spec = node.meta.get(KERNEL)
        if not isinstance(spec, SummaSpec):
            continue
        site = Site.inserted(node, mesh, grads, (0, 0))
        per_axis, n = spec.axis_bytes(site), spec.products(site)
        transfer = sum(per_axis[a] / cm.beta[a] for a in range(2) if mesh[a] > 1) * n
        compute = spec.flops(site) / cm.flops
        if SummaSpec.lowering(node) == "allgather":
            behind = hidden_dw_reduction(spec, site, cm) if grid.overlap_grad_reduce else 0.0
        else:
            steps = spec.launches(site, "broadcast")
            behind = transfer + compute - double_buffered(transfer, compute, cm, steps) if on else 0.0
        total, hidden, products = total + transfer, hidden + behind, products + 1
    if not products:
        return None
    how = ("on (the next SUMMA panel posted before each matmul, weight-gradient reductions behind the input "
           "gradient's product)" if on else "off (every transfer waited for before the compute that follows)")
    return (f"overlap: {how}; the cost model ({cm.source}) hides {cm.hidden:.0%} of a transfer beside a matmul: of "
            f"the {products} SUMMA products' transfers, {total * 1e3:.3g} ms per step, {hidden * 1e3:.3g} ms run "
            f"behind matmuls and {(total - hidden) * 1e3:.3g} ms are exposed (estimate)")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(every: list, verbose: bool, formulas: bool) -> tuple:
    """(lines of the op table, the rows listed): the ops that move bytes or fell back, or every op."""
    table = every if verbose else [r for r in every if r.fwd_bytes or r.bwd_bytes or r.fallback]
    head = ("node", "op", "module", "layout", "collectives", "fwd/rank", "bwd/rank", "note")
    cells = [head] + [(r.node, r.op, r.module, r.layout, r.collectives, _fmt_bytes(r.fwd_bytes) if r.fwd_bytes else "",
                       _fmt_bytes(r.bwd_bytes) if r.bwd_bytes else "", r.note) for r in table]
    widths = [min(max(len(c[i]) for c in cells), 60) for i in range(len(head))]
    lines = ["  ".join(c[i][:60].ljust(widths[i]) for i in range(len(head))).rstrip() for c in cells[:1]]
    lines.append("  ".join("-" * w for w in widths))
    for r, c in zip(table, cells[1:]):
        # the note (last column) is never cut: it carries the auto strategy's reasons
        lines.append("  ".join(c[i][:60].ljust(widths[i]) if i < len(head) - 1 else c[i]
                               for i in range(len(head))).rstrip())
        if formulas and r.formula:
            lines.append(f"    why: {r.formula}")
    return lines, table


def context_line(pmodel, gm) -> str | None:
    """context_parallel: the attentions' flavours and what they receive per rank and step, as priced
    (`passes.cost.context`); None without it."""
    cp = getattr(pmodel.grid, "cp", 1)
    if cp <= 1:
        return None
    mods = [m for m in gm.modules() if isinstance(m, ContextAttention)]
    fwd = bwd = 0
    for m in mods:
        f, b = step_bytes(*m.blocks, cp, m.flavour)
        fwd, bwd = fwd + f, bwd + b
    kinds = ", ".join(f"{sum(m.flavour == k for m in mods)} {k}" for k in FLAVOURS
                      if any(m.flavour == k for m in mods))
    return (f"context parallel over {cp} ranks (zig-zag; the replicas above): {len(mods)} attention(s) ({kinds}), "
            f"receiving per rank per step forward {_fmt_bytes(fwd)}, backward {_fmt_bytes(bwd)}, not in the totals "
            f"above; plus the gather of the outputs with a sequence dim and the loss's sum")


def explain(pmodel, *, verbose: bool = False, formulas: bool = False) -> str:
    """A readable table of the compiled model (see the module docstring): the ops that move bytes or
    fell back, or with `verbose` every op. With `formulas`, each row that moves bytes is followed by
    its cost as a sympy expression and the values it was evaluated at. `pmodel` may also be a Plan
    (`autopar.plan(...)`, no processes needed): the same table, and its totals and memory. For a
    pipelined model, this rank's stage, under a line naming the stage and its point-to-point sends."""
    if hasattr(pmodel, "rows") and hasattr(pmodel, "to_json"):  # a Plan (plan.py imports this module)
        return _explain_plan(pmodel, verbose, formulas)
    if hasattr(pmodel, "stage_modules") and hasattr(pmodel, "p2p_traffic"):  # a PipelineModule: its stages
        g, pipe = pmodel.grid, pmodel.pipeline
        first = g.stage * g.dp * g.world
        sends = "; ".join(f"{ph} {calls} sends, {_fmt_bytes(nbytes)}" for ph, (calls, nbytes) in
                          pmodel.p2p_traffic().items() if calls)
        est = bubble(pipe.schedule, pipe.stages, pipe.n_microbatches, pipe.stages_per_rank)
        head = (f"pipeline rank {g.stage} of {pipe.stages} (ranks {first}-{first + g.dp * g.world - 1}), stages "
                f"{pmodel.stage_ids} of {pipe.total}, schedule {pipe.schedule!r}, {pipe.n_microbatches} "
                f"micro-batches, estimated bubble {est:.0%} of the step; to its neighbouring stages per training "
                f"step: {sends or 'nothing'}")
        return "\n".join([head] + [f"\nstage {i}:\n" + explain(pm, verbose=verbose, formulas=formulas)
                                   for i, pm in zip(pmodel.stage_ids, pmodel.stage_modules)])
    if not hasattr(pmodel, "program"):
        raise UsageError(f"autopar.explain takes what autopar.parallelize returns (a ParallelModule) or what "
                        f"autopar.plan returns (a Plan), not {type(pmodel).__name__}")
    every = rows(pmodel)
    lines, table = _table(every, verbose, formulas)
    fwd = sum(r.fwd_bytes for r in table)
    bwd = sum(r.bwd_bytes for r in table)
    held = sum(p.to_local().numel() * p.element_size() for p in pmodel.parameters())
    full = sum(p.numel() * p.element_size() for p in pmodel.parameters())
    (R, C), p = pmodel.grid.shape, pmodel.grid.world
    comp = pmodel.program
    hidden = len(every) - len(table)
    lines += [
        *([f"({hidden} more ops move no bytes; explain(pmodel, verbose=True) lists every op)"] if hidden else []),
        "",
        f"grid {R}x{C}; bytes received per rank per training step: forward {_fmt_bytes(fwd)}, "
        f"backward {_fmt_bytes(bwd)}, total {_fmt_bytes(fwd + bwd)}",
        collectives_line(pmodel, every),
        *([line] if (line := overlap_line(pmodel, comp.inspected)) else []),
        *([line] if (line := context_line(pmodel, comp.gm)) else []),
        f"parameters held by this rank: {_fmt_bytes(held)} of {_fmt_bytes(full)} "
        f"({held / full * p:.2f}/p of the model, p={p})" if full else "no parameters",
    ]
    if comp.flat is not None:
        again = sum(r.recompute_bytes for r in every)
        regions = len({n.meta[RECOMPUTE] for n in comp.flat.graph.nodes if RECOMPUTE in n.meta})
        lines.append(f"recomputation: {regions} regions run again in backward, receiving {_fmt_bytes(again)} more "
                     f"per rank per step (their forward collectives, repeated)")
    stats = getattr(pmodel, "compile_stats", {}).get(comp.signature)
    if stats is not None:
        lines.append(f"torch.compile: {stats.graphs} graph(s), {stats.breaks} graph break(s)")
    lines += uneven.summary_lines(pmodel, fwd + bwd)
    if getattr(pmodel, "arrangement", None):
        lines += ["arrangement (grid=p: every candidate the search priced for these devices):"]
        lines += ["  " + line for line in arrangement_lines(pmodel.arrangement)]
    if comp.choice is not None:
        lines += strategy_summary(comp.choice)
    if comp.fallbacks:
        lines.append(f"fallbacks ({len(comp.fallbacks)}): run whole on every rank")
        lines += [f"  {f.node.name} ({f.node.target}) in {f.path or '<top>'}: {f.reason}"
                  + ("" if f.costly else " [inputs already whole: nothing gathered]")
                  for f in comp.fallbacks]
    else:
        lines.append("fallbacks: none")
    return "\n".join(lines + generation_lines(pmodel))


def held_above(above: dict, held: int, shown: int = 6) -> str:
    """The parameters a rank holds more than 1/p of: all names when few, else a count, their share of
    what the rank holds and the first names (a model's 65 norm weights would fill the screen).

    >>> held_above({"ln.weight": 8, "ln.bias": 8}, 1000)
    'ln.weight, ln.bias'
    >>> held_above({f"h.{i}.ln.weight": 8 for i in range(8)}, 6400, shown=2)[:70]
    "8 tensors, 1.00% of this rank's parameter bytes: h.0.ln.weight, h.1.ln"
    """
    if len(above) <= shown:
        return ", ".join(above) or "none"
    share = sum(above.values()) / held if held else 0.0
    return (f"{len(above)} tensors, {share:.2%} of this rank's parameter bytes: {', '.join(list(above)[:shown])}, "
            f"... (all in --json's params_above_1_over_p)")


def mib(n) -> str:
    return f"{n / 2**20:.2f}" if n is not None else "-"


def summary_lines(pl) -> list:
    """A plan's totals: bytes and collective calls per rank per step, memory per rank, what is held
    above 1/p and the costly fallbacks."""
    j = pl.to_json()
    return [
        f"grid {pl.grid[0]}x{pl.grid[1]}, per rank per training step: {mib(j['comm_bytes_per_rank_per_step'])} MiB "
        f"received in {j['collectives_per_rank_per_step']} collective calls, "
        f"{j['flops_per_rank_per_step'] / 1e12:.3f} TFLOP (matmuls)",
        f"memory per rank: parameters {mib(j['param_bytes_per_rank'])} MiB "
        f"(model {mib(j['param_bytes_total'])} MiB), "
        f"gradients {mib(j['grad_bytes_per_rank'])} MiB, AdamW states {mib(j['adamw_state_bytes_per_rank'])} MiB, "
        f"saved for backward {mib(j['activation_bytes_per_rank'])} MiB, largest tensor "
        f"{mib(j['largest_tensor_bytes'])} MiB",
        f"held above 1/p: {held_above(j['params_above_1_over_p'], j['param_bytes_per_rank'])}",
        f"costly fallbacks: {', '.join(f['node'] for f in j['fallback_nodes'] if f['costly']) or 'none'}",
        *(f"  {f.node.name} ({f.node.target}) in {f.path or '<top>'} runs whole: {f.reason}"
          + ("" if f.costly else " [its inputs are already whole: nothing is gathered]") for f in pl.fallbacks),
        *replica_lines(pl.replicas),
    ]


def replica_lines(rep) -> list:
    """grid=(dp, R, C): what the replica axis moves and what a rank holds between steps."""
    if rep is None:
        return []
    how = (f"FSDP2's all-gathers of the parameters and reduce-scatters of the gradients in {rep.units} units, "
           f"at most {mib(rep.gathered_bytes)} MiB gathered at once" if rep.data_parallel == "shard"
           else "gradient all-reduces in buckets")
    return [f"replicas: {rep.dp} of the grid, data_parallel={rep.data_parallel!r}: {rep.calls} more calls per rank "
            f"per step ({how}), {mib(rep.received_bytes)} MiB received; held between steps: parameters "
            f"{mib(rep.param_bytes)} MiB, with gradients and AdamW states {mib(rep.state_bytes())} MiB"]


def arrangement_lines(table: list) -> list:
    """A line per candidate arrangement of the search (`GridChoice.to_json()` rows): its estimated step
    under the per-unit search and under each fixed scheme, its memory, and why it was not searched or
    does not fit; the chosen one marked."""
    out = []
    for row in table:
        where = describe(row["layout"], tuple(row["grid"]))
        fixed = ", ".join(f"fixed {k} {t * 1e3:.1f} ms" for k, t in row["fixed_s"].items())
        if row["searched"] and row["fits"]:
            out.append(f"{where}: estimated step auto {row['auto_s'] * 1e3:.1f} ms, {fixed}, memory "
                       f"{row['memory_bytes'] / 2**30:.2f} GiB/rank" + ("   <- chosen" if row["picked"] else ""))
        else:
            out.append(f"{where}: {fixed}; {row['why']}")
    return out


def _explain_plan(pl, verbose: bool, formulas: bool) -> str:
    """explain for a Plan: its op table, then the totals and memory of `autopar.planning.report`."""
    lines, table = _table(pl.rows, verbose, formulas)
    hidden = len(pl.rows) - len(table)
    lines += [f"({hidden} more ops move no bytes; explain(plan, verbose=True) lists every op)"] if hidden else []
    lines += ["", *summary_lines(pl)]
    if pl.choice is not None:
        lines += strategy_summary(pl.choice)
    return "\n".join(lines)


def generation_lines(pmodel) -> list:
    """Footer for a model that generated (`pmodel.generate`): per compiled program (prefill, decode;
    keyed as `autopar.generate` says) its bytes received per rank per call and per token and its plan
    (strategy, estimated forward time, SUMMA lowerings: `generate_phases.PhasePlan`), the KV cache this
    rank holds and its memory (parameter blocks + copies for the phases' own plans + cache). Empty
    before the first generate."""
    gen = pmodel.generator
    if not gen.programs:
        return []
    lines = ["", "generation (inference: no backward, nothing saved for it):"]
    for key, comp in gen.programs.items():
        phase, batch, length, *prompt, _ = key
        fwd = sum(r.fwd_bytes for r in graph_rows(comp.gm, pmodel.grid.shape))
        tokens = batch * (prompt[0] if prompt else 1)
        shape = f"B={batch} P={prompt[0]}" if prompt else f"B={batch}, one token each"
        lines.append(f"  {phase:<7} ({shape}, cache L={length}): received per rank {_fmt_bytes(fwd)} per call, "
                     f"{_fmt_bytes(fwd / tokens)} per token; strategy " + gen.plans[key].describe())
    cache, copies = gen.kv_cache_bytes(), gen.relaid.nbytes()
    held = sum(p.to_local().numel() * p.element_size() for p in pmodel.parameters())
    if copies:
        lines.append(f"  parameter copies for the phases' own plans: {len(gen.relaid)} block(s), {_fmt_bytes(copies)} "
                     f"per rank (kept across calls, refreshed when a parameter changes)")
    if gen.cache_key is not None:
        lines.append(f"  KV cache (B={gen.cache_key[0]}, L={gen.cache_key[1]}, layout {gen.cache_layout}): "
                     f"kv_cache_bytes_per_rank {cache} ({_fmt_bytes(cache)}); memory per rank: parameters "
                     f"{_fmt_bytes(held)} + copies {_fmt_bytes(copies)} + cache {_fmt_bytes(cache)} = "
                     f"{_fmt_bytes(held + copies + cache)}")
    return lines
