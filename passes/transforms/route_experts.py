"""Route experts: rewrite each captured grouped-experts region for expert parallelism (a GraphModule
pass, before propagation, on grids of more than one row).

transformers 5's grouped experts leave, per MoE layer, the routing as plain aten ops around two
grouped matmuls (see docs/design.md section 8):

    ids_g, perm = sort(ids [Tk]);  x = h [T, H][perm // k]  (-> to)        -> moe_dispatch(h, ids, k, E)
    offs = cumsum(histc(ids_g))                                            -> moe_offsets(ids, E)
    y = grouped_mm(act(grouped_mm(x, w1, offs)), w2, offs)                    (kept)
    (y * w[perm][:, None])[inv_perm].view(T, k, H).sum(1)                  -> moe_combine(y, w, ids, k, E)

Ops of ours stand in for the sort and the two gathers (`passes.ops.moe_dispatch`); their rules
(`passes.rules.moe.routing`) keep the tokens split over the rows and exchange them with all-to-alls.
A region that does not match is left as captured (the gathered dispatch) and named in a warning.
Requires `val` on every node; sets it on the nodes it adds. `mode`: `Options.moe_dispatch`.

>>> resolve("auto", (2, 2)), resolve("auto", (1, 4)), resolve("gather", (2, 2))
('all_to_all', 'gather', 'gather')
"""

from __future__ import annotations

import operator
from typing import cast

import torch
from torch.fx import GraphModule, Node

from passes.compat import detect_fake_mode, fake_tensor_mode
from passes.mesh import warn
from passes.nodes import arg
from passes.rules.moe.experts import is_grouped_mm, reads_first_matmul
from passes.errors import RoutingWarning

aten = torch.ops.aten
MODES = ("auto", "all_to_all", "gather")



def resolve(mode: str, mesh: tuple) -> str:
    """The dispatch `mode` comes to on a grid of shape `mesh`. 'auto' picks by the grid's shape what the
    byte counts say: on more than one row, all-to-all (the gathered dispatch all-reduces the routed
    copy's gradient [Tk, H] over both axes, more than all of the all-to-all dispatch's traffic, which
    moves each routed pair's [H/C] block and gathers H only for a row's own pairs: 940 MB against 66 MB
    per Mixtral-8x7B layer at 8x8); on one row there is nothing to exchange (the routing kernels are
    not built there) and the gathered dispatch runs."""
    return ("all_to_all" if mesh[0] > 1 else "gather") if mode == "auto" else mode


def _through_casts(x: Node) -> tuple:
    """(the node under x's same-dtype casts, whether every cast between keeps the dtype)."""
    same = True
    while x.op == "call_function" and getattr(x.target, "overloadpacket", None) in (aten.to, aten._to_copy):
        src = x.args[0]
        same = same and src.meta["val"].dtype == x.meta["val"].dtype
        x = src
    return x, same


def _sort_of(perm: Node) -> Node | None:
    """The sort whose indices `perm` is (getitem 1 of aten.sort), else None."""
    if perm.target is operator.getitem and perm.args[1] == 1 and perm.args[0].target == aten.sort.default:
        return perm.args[0]
    return None


def _weights_at(factor, perm: Node) -> Node | None:
    """w when `factor` is unsqueeze(w[perm], -1) (the routing weights in sorted order), else None."""
    if not isinstance(factor, Node) or factor.target != aten.unsqueeze.default:
        return None
    pick = factor.args[0]
    return pick.args[0] if pick.target == aten.index.Tensor and list(pick.args[1]) == [perm] else None


class _Region:
    """One layer's routed region, matched from its first grouped matmul; `missing` says what did not match."""

    def __init__(self, g1: Node):
        self.g1, self.missing = g1, ""
        x, same_dtype = _through_casts(g1.args[0])
        if not same_dtype:  # the dispatch's backward expects the first matmul's column partials, uncast
            self.missing = "the routed tokens are cast to another dtype before the first matmul"
            return
        if x.target != aten.index.Tensor or len(x.args[1]) != 1 or x.args[1][0] is None:
            self.missing = "the routed tokens are not an index of the hidden states"
            return
        self.index, self.h, fd = x, x.args[0], x.args[1][0]
        sort = _sort_of(fd.args[0]) if fd.target in (aten.floor_divide.default, aten.div.Tensor_mode) else None
        if sort is None:
            self.missing = "the token index is not sort(ids).indices // k"
            return
        self.perm, self.k, self.ids = fd.args[0], fd.args[1], sort.args[0]
        self.offs = arg(g1, 2, "offs")
        seconds = [u for u in self.offs.users if is_grouped_mm(u) and u is not g1 and reads_first_matmul(u, u.args[0])]
        if len(seconds) != 1 or not isinstance(self.k, int):
            self.missing = "no single second grouped matmul on the same offsets"
            return
        self.g2 = seconds[0]
        self._combine()

    def _combine(self) -> None:
        """mul(y, unsqueeze(w[perm], -1)) -> [inv_perm] -> view(T, k, H) -> sum(1)."""
        chain, node = [], self.g2
        for target in (aten.mul.Tensor, aten.index.Tensor, aten.view.default, aten.sum.dim_IntList):
            users = list(node.users)
            if len(users) != 1 or users[0].target != target:
                break
            node = users[0]
            chain.append(node)
        if len(chain) == 4 and chain[0].args[0] is self.g2 and _weights_at(chain[0].args[1], self.perm) is not None \
                and list(chain[3].args[1]) == [1] and not (len(chain[3].args) > 2 and chain[3].args[2]):
            self.w, self.sum = cast(Node, _weights_at(chain[0].args[1], self.perm)), chain[3]
        else:
            self.missing = "the combine is not (y * w[perm])[inv_perm].view(T, k, H).sum(1)"

    def rewrite(self, gm: GraphModule) -> None:
        g, experts = gm.graph, self.g1.args[1].meta["val"].shape[0]
        fake = detect_fake_mode([self.h.meta["val"]])
        with g.inserting_before(self.index):
            disp = g.call_function(torch.ops.autopar.moe_dispatch.default, (self.h, self.ids, self.k, experts))
            offs = g.call_function(torch.ops.autopar.moe_offsets.default, (self.ids, experts))
        with g.inserting_before(self.sum):
            comb = g.call_function(torch.ops.autopar.moe_combine.default, (self.g2, self.w, self.ids, self.k, experts))
        for new, old in ((disp, self.index), (offs, self.offs), (comb, self.sum)):
            new.meta.update({k: v for k, v in old.meta.items() if k in ("nn_module_stack", "stack_trace")})
        with fake or fake_tensor_mode():
            disp.meta["val"] = torch.ops.autopar.moe_dispatch(self.h.meta["val"], self.ids.meta["val"], self.k,
                                                              experts)
            offs.meta["val"] = torch.ops.autopar.moe_offsets(self.ids.meta["val"], experts)
            comb.meta["val"] = torch.ops.autopar.moe_combine(self.g2.meta["val"], self.w.meta["val"],
                                                             self.ids.meta["val"], self.k, experts)
        # the first matmul reads the dispatch directly (the casts between keep the dtype), so that its
        # gradient's column partials reach the dispatch, which sums them, and no GradSync of a cast does
        routed = self.g1.args[0]
        self.g1.replace_input_with(routed, disp)
        for u in list(self.offs.users):
            if u in (self.g1, self.g2):
                u.replace_input_with(self.offs, offs)
        self.sum.replace_all_uses_with(comb)
        _erase_dead([routed, self.index, self.offs, self.sum])


def _erase_dead(starts: list) -> None:
    """Erase the nodes left without users, from `starts` back through their inputs."""
    todo = list(starts)
    while todo:
        n = todo.pop()
        if n._erased or n.users or n.op != "call_function":
            continue
        ins = list(n.all_input_nodes)
        n.graph.erase_node(n)
        todo.extend(ins)


def route_experts(gm: GraphModule, mesh: tuple, mode: str) -> list:
    """Rewrite every matching region when `mode` resolves to 'all_to_all' on `mesh`; returns the
    (layer path, what did not match) of the regions left gathered, each also warned about."""
    if resolve(mode, mesh) != "all_to_all":
        return []
    kept = []
    for node in list(gm.graph.nodes):
        if node._erased or not is_grouped_mm(node) or reads_first_matmul(node, node.args[0]):
            continue
        region = _Region(node)
        if region.missing:
            path = next(reversed(node.meta.get("nn_module_stack", {}).values()), ("", None))[0]
            kept.append((path or f"<top> ({node.name})", region.missing))
        else:
            region.rewrite(gm)
    if kept:
        lines = "\n".join(f"  {p}: {why}" for p, why in kept)
        warn(f"autopar: moe_dispatch='all_to_all': {len(kept)} MoE layer(s) keep the gathered token dispatch "
             f"(their routing is not the grouped pattern this rewrite knows):\n{lines}", RoutingWarning)
    gm.graph.lint()
    gm.recompile()
    return kept
