"""`python -m autopar bench --dimensions`: 1D, 2D and 3D tensor parallelism side by side for the linears
of a Llama-7B and a Llama-70B shape at 64 and 512 ranks, from the formulas (`passes.cost.cube`); no
process group, nothing run.

The tokens of one step on the grid: 16 sequences of 4096 (7B), 8 of 8192 (70B).
Per rank and training step (forward and backward, fp16/bf16: 2 bytes per element), for the linears of
the blocks and the LM head: bytes received, parameter bytes held, the bytes of the linears' inputs held
for backward, and the bytes received over the Loomis-Whitney lower bound of each product
(`matmul_lower_bound`, which counts what a rank sends or receives, so a ratio below 1 is possible for
an algorithm whose sends are not counted as received). 1D is Megatron's (`passes.cost.cube.megatron_bytes`,
what `autopar.compare_1d` prices): four all-reduces of [M, h] per block (attention and MLP, forward and
backward) and one for the vocabulary split; 2D is SUMMA on R x C (`summa_linear_bytes`); 3D the depth
algorithm on q x q x q (`cube_linear_bytes`). Attention, norms and the loss are not counted.
"""

from __future__ import annotations

import json

from passes.cost.cube import cube_linear_bytes, matmul_lower_bound, megatron_bytes, summa_linear_bytes

E = 2  # bf16
SHAPES = {  # hidden, intermediate, layers, key/value width, vocabulary, tokens per step
    "Llama-7B": dict(h=4096, f=11008, layers=32, kv=4096, vocab=32000, tokens=16 * 4096),
    "Llama-70B": dict(h=8192, f=28672, layers=80, kv=1024, vocab=128256, tokens=8 * 8192),
}
LAYOUTS = {64: [("1D 1x64", ("1d", 64)), ("2D 8x8", ("2d", 8, 8)), ("3D 4x4x4", ("3d", 4))],
           512: [("1D 1x512", ("1d", 512)), ("2D 16x32", ("2d", 16, 32)), ("3D 8x8x8", ("3d", 8))]}


def linears(s: dict) -> list:
    """(K, N) of each linear of one block, then the LM head's, in the math layout x [M, K] . W [K, N]."""
    h, f, kv = s["h"], s["f"], s["kv"]
    return [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]


def row(s: dict, layout: tuple) -> dict:
    M, h, f, L, V = s["tokens"], s["h"], s["f"], s["layers"], s["vocab"]
    kind, p = layout[0], (layout[1] if layout[0] == "1d" else layout[1] * layout[2] if layout[0] == "2d"
                          else layout[1] ** 3)
    shapes = [(K, N, L) for K, N in linears(s)] + [(h, V, 1)]
    params = sum(K * N * n for K, N, n in shapes)
    if kind == "1d":
        received = sum(megatron_bytes(M, h, L, p, E))
        held_inputs = L * (2 * M * h + M * h // p + M * f // p) + M * h  # q|k|v and gate|up read x whole
    else:
        one = (lambda K, N: summa_linear_bytes(M, K, N, layout[1], layout[2], E)) if kind == "2d" else \
            (lambda K, N: cube_linear_bytes(M, K, N, layout[1], E))
        received = sum(n * sum(one(K, N)) for K, N, n in shapes)
        held_inputs = (L * (3 * M * h + M * f) + M * h) // p
    bound = sum(n * 3 * matmul_lower_bound(M, K, N, p) for K, N, n in shapes) * E
    return {"p": p, "received": received, "params": params * E // p, "inputs": held_inputs * E,
            "over_bound": received / bound if bound else float("inf")}


def table() -> dict:
    return {name: {p: {label: row(s, lay) for label, lay in LAYOUTS[p]} for p in LAYOUTS} for name, s in SHAPES.items()}


def markdown(res: dict) -> str:
    lines = ["| model | ranks | layout | received/rank/step | params/rank | linear inputs held/rank | "
             "received / lower bound |", "|---|---|---|---|---|---|---|"]
    for name, per_p in res.items():
        for p, rows in per_p.items():
            for label, r in rows.items():
                lines.append(f"| {name} | {p} | {label} | {r['received'] / 2**30:.2f} GiB | "
                             f"{r['params'] / 2**30:.2f} GiB | {r['inputs'] / 2**30:.2f} GiB | "
                             f"{_ratio(r['over_bound'])} |")
    return "\n".join(lines)


def _ratio(x: float) -> str:
    return "-" if x == float("inf") else f"{x:.2f}"


def run(ns) -> int:
    res = table()
    print(json.dumps(res, indent=2) if ns.json else markdown(res))
    return 0
