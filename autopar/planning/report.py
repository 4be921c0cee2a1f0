"""Views of a Plan: a table grouped by module path, Graphviz DOT, a self-contained HTML page, and a
grid sweep comparing 2D with 1D."""

from __future__ import annotations

import html as _html
from collections import defaultdict

from autopar.planning.explain import mib, summary_lines


def group_by_module(pl) -> str:
    """Bytes and FLOPs per module path (two levels: e.g. transformer.h.3), then totals."""
    groups = defaultdict(lambda: [0, 0, 0, set()])
    for r in pl.rows:
        key = ".".join(r.module.split(".")[:3]) if r.module else "<top>"
        g = groups[key]
        g[0] += r.fwd_bytes
        g[1] += r.bwd_bytes
        if r.fallback:
            g[3].add(r.node)
    width = max([len(k) for k in groups] + [6])
    lines = [f"{'module':<{width}}  {'fwd MiB':>9}  {'bwd MiB':>9}  fallbacks",
             f"{'-' * width}  {'-' * 9}  {'-' * 9}  ---------"]
    for key, (f, b, _, fb) in groups.items():
        lines.append(f"{key:<{width}}  {mib(f):>9}  {mib(b):>9}  {', '.join(sorted(fb))}")
    return "\n".join(lines + ["", *summary_lines(pl)])



_COLORS = {"S(0)S(2)": "#a6cee3", "S(0)S(1)": "#b2df8a", "RR": "#eeeeee"}


def _color(layout: str) -> str:
    if layout in _COLORS:
        return _COLORS[layout]
    return "#fdbf6f" if "P(" in layout else "#cab2d6"


def dot(pl) -> str:
    """The per-rank graph in Graphviz DOT: nodes colored by layout, collectives drawn as boxes."""
    from passes.layout import REPLICATED  # here, not above: `require_matplotlib` runs before torch loads
    from passes.meta import LAYOUT

    gm = pl.gm
    lines = ["digraph autopar {", "  rankdir=TB; node [style=filled, fontsize=10];"]
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        lay = repr(node.meta.get(LAYOUT, REPLICATED))
        comm = node.op == "call_module"
        label = f"{node.name}\\n{lay}"
        shape = "box" if comm else "ellipse"
        lines.append(f'  "{node.name}" [label="{label}", shape={shape}, fillcolor="{_color(lay)}"];')
        for a in node.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)


def html(pl) -> str:
    """A self-contained page: the plan's rows, colored by layout, with costs."""
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in ("node", "op", "module", "layout", "collectives",
                                                       "fwd bytes", "bwd bytes", "note")) + "</tr>"
    body = []
    for r in pl.rows:
        cells = [r.node, r.op, r.module, r.layout, r.collectives, r.fwd_bytes or "", r.bwd_bytes or "", r.note]
        body.append(f'<tr style="background:{_color(r.layout)}">' +
                    "".join(f"<td>{_html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return (f"<!doctype html><meta charset=utf-8><title>autopar plan {pl.grid}</title>"
            f"<style>td,th{{font:12px monospace;padding:2px 6px}}</style>"
            f"<table>{head}{''.join(body)}</table>")


def sweep_table(model, args, kwargs, limit: int, tokens: int, layers: int, hidden: int) -> list:
    """2D on every square grid with q*q <= limit, and 1D at the same p: bytes and parameters per rank."""
    from autopar.planning.plan import compare_1d, plan

    out = []
    q = 1
    while (q + 1) ** 2 <= limit:
        q += 1
        pl = plan(model, grid=(q, q), example_inputs=args, example_kwargs=kwargs, measure_activations=False)
        one = compare_1d(pl, model, tokens, layers, hidden)
        unsplit = sum(1 for f in pl.fallbacks if f.costly)
        cheaper = "2d" if pl.comm_bytes_per_rank_per_step < one["comm_bytes_per_rank_per_step"] else "1d"
        out.append({"p": q * q, "2d_comm_bytes": pl.comm_bytes_per_rank_per_step, "1d_comm_bytes":
                    one["comm_bytes_per_rank_per_step"], "2d_param_bytes": pl.param_bytes_per_rank,
                    "1d_param_bytes": one["param_bytes_per_rank"], "2d_ops_unsplit": unsplit,
                    "cheaper_comm": cheaper if not unsplit else f"{cheaper} (2D runs {unsplit} op(s) unsplit: "
                                                                  f"sizes not divisible by q={q})"})
    best_2d = min((r for r in out if not r["2d_ops_unsplit"]), key=lambda r: r["2d_comm_bytes"], default=None)
    best_1d = min(out, key=lambda r: r["1d_comm_bytes"], default=None)
    if best_2d and best_1d:
        two_d = best_2d["2d_comm_bytes"] <= best_1d["1d_comm_bytes"]
        scheme, p, n = (("2d", best_2d["p"], best_2d["2d_comm_bytes"]) if two_d
                        else ("1d", best_1d["p"], best_1d["1d_comm_bytes"]))
        out.append({"cheapest": f"{scheme} at p={p}: {n / 2**20:.1f} MiB received per rank per step"})
    return out


def require_matplotlib(what: str):
    """matplotlib.pyplot drawing to files (the Agg backend); without matplotlib, a SystemExit saying
    how to install it. Commands call it before their work starts, not after."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"{what} needs matplotlib, which is not installed: pip install 'autopar[plot]' "
                         "(in a checkout: pip install -e '.[plot]'), or leave out --plot") from None
    return plt


def plot(rows: list, path: str) -> None:
    """Bytes and parameter memory per rank against p, 2D and 1D (needs matplotlib). p is on a log axis
    with a tick at each p swept; every tick is labelled as a plain number (no 10^x minor labels, which
    crowd each other on an axis spanning one or two decades)."""
    plt = require_matplotlib("autopar inspect --plot")
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    rows = [r for r in rows if "p" in r]
    ps = [r["p"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    ok = [r for r in rows if not r["2d_ops_unsplit"]]  # grids q does not divide the model for are left out
    for ax, kind in ((a, "comm"), (b, "param")):
        ax.plot([r["p"] for r in ok], [r[f"2d_{kind}_bytes"] / 2**20 for r in ok], marker="o", label="2D (q x q grid)")
        ax.plot(ps, [r[f"1d_{kind}_bytes"] / 2**20 for r in rows], marker="o", label="1D")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ps))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("p (ranks)")
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_ylabel("MiB received per rank per step")
    a.set_ylim(bottom=0)
    b.set_yscale("log")
    b.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    b.yaxis.set_major_formatter(plain)
    b.yaxis.set_minor_formatter(NullFormatter())
    b.set_ylabel("MiB of parameters per rank")
    fig.savefig(path, dpi=120)
