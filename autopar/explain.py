"""`explain`: what the compiler did, as a table."""

from __future__ import annotations


def explain(pmodel) -> str:
    gm = pmodel.graph_module if hasattr(pmodel, "_last") else next(iter(pmodel._compiled.values())).gm
    return gm.code
