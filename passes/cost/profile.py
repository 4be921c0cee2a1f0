"""What one training step of a captured model costs before it is split: per repeated block and for
everything outside the blocks (embedding, final norm, head, loss), the work a roofline prices.

Read off the captured (unsplit) graph of one sequence, once per model and sequence length (every
figure but the parameters grows linearly with the batch):

- `mm`: every linear / matmul product as (M, K, N): 2 M K N FLOPs forward, twice that backward;
- `attention_flops`: scaled-dot-product attention's forward FLOPs, 4 b h s_q s_k d, halved for a
  causal mask (flash kernels skip the masked half: Dao 2023, FlashAttention-2, section 3.1); its
  backward is priced at 2.5 times the forward (two more products and the recomputed scores);
- `memory_bytes`: the bytes that the memory-bound ops (norms, activations, residual adds, RoPE,
  casts, copies, the loss) read and write in the forward: inputs read once, the output written once
  (eager mode: one kernel per op); the backward of such an op is priced at twice its forward;
- `saved`: the bytes autograd keeps for backward, measured by running the graph on fake tensors
  with a saved-tensor hook (each storage once), so an attention kernel that saves O(s) (flash's
  log-sum-exp) is counted as it is, never as O(s^2);
- `sac_saved` / `sac_recompute_flops`: per-op selective recomputation as torchtitan's default
  (`activation_checkpoint.mode="selective"`, option "op") runs it: the block's input, the outputs of
  every other matmul (the first, third, ...) and of attention are kept; the rest is rebuilt in
  backward, so the skipped matmuls' FLOPs and the memory-bound ops run again;
- `input_bytes`: the block's activation input, all that full recomputation keeps.

Bytes assume the dtypes the graph was captured with (capture a bf16 model for bf16 training).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Interpreter

from passes.compat import fake_tensor_mode, storage_key
from passes.meta import PARAM, ROLE
from passes.nodes import block_of, block_path

__all__ = ["Part", "Profile", "profile"]

LINEAR = ("aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.addmm.default",
          "aten.bmm.default", "aten.baddbmm.default")
ATTENTION = ("aten.scaled_dot_product_attention.default",)
VIEWS = {"aten.view.default", "aten.transpose.int", "aten.permute.default", "aten.unsqueeze.default",
         "aten.expand.default", "aten.slice.Tensor", "aten.alias.default", "aten.t.default",
         "aten.squeeze.dim", "aten.squeeze.default", "aten.select.int", "aten.split.Tensor", "aten.detach.default",
         "aten._unsafe_view.default", "aten.unbind.int", "aten.chunk.default", "aten.split_with_sizes.default",
         "aten.flatten.using_ints", "aten.unflatten.int", "aten.view_as.default", "aten.dropout.default",
         "aten.expand_as.default", "aten.narrow.default"}
_POSITION_TESTS = ("aten.le.Tensor", "aten.ge.Tensor", "aten.lt.Tensor", "aten.gt.Tensor", "aten.tril.default",
                   "aten.triu.default")
COPIES_IF_STRIDED = {"aten.reshape.default", "aten.contiguous.default", "aten.flatten.using_ints"}


@dataclass
class Part:
    """The costs of one part of the model for one sequence (see the module docstring)."""

    mm: list = field(default_factory=list)  # (M, K, N) per product, in graph order
    mm_inputs: list = field(default_factory=list)  # the activation each product reads (its node's name)
    attention_flops: float = 0.0
    attention_scores: float = 0.0  # (query, key) pairs attention scores, b h s_q s_k (halved causal)
    memory_bytes: float = 0.0
    saved: float = 0.0
    sac_saved: float = 0.0
    sac_recompute_flops: float = 0.0
    input_bytes: float = 0.0
    params: int = 0  # elements
    largest_output: float = 0.0  # bytes of the largest tensor an op of this part makes (the logits)
    ops: int = 0  # graph ops (each pays a per-op floor on an eager CPU step: `Cluster.op_s`)

    def groups(self) -> list:
        """The products in runs that read one input (q|k|v, gate|up): each run is what one tensor-parallel
        collective (the input's all-gather, or the output's reduce-scatter) sits beside."""
        out: list = []
        for i, x in enumerate(self.mm_inputs):
            if out and self.mm_inputs[out[-1][-1]] == x:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    @property
    def mm_flops(self) -> float:
        return sum(2.0 * m * k * n for m, k, n in self.mm)


@dataclass
class Profile:
    block: Part  # one middle repeated block
    outer: Part  # everything else
    blocks: int  # repeated blocks in the captured graph
    block_ids: tuple
    hidden: int  # the block input's last dim
    param_dtype_bytes: int


def _bytes(v) -> float:
    return float(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0.0


def _tensors(node) -> list:
    return [a.meta.get("val") for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _causal(node) -> bool:
    """An attention call whose mask is causal: `is_causal`, or a boolean [.., s, s] mask built from
    position comparisons (what transformers passes a decoder)."""
    if node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]):
        return True
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    seen: set = set()
    todo = [mask] if isinstance(mask, torch.fx.Node) else []
    while todo and len(seen) < 64:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if str(n.target) in _POSITION_TESTS:
            return True
        todo += list(n.all_input_nodes)
    return False


def profile(gm: torch.fx.GraphModule) -> Profile:
    """The profile of captured graph `gm`, captured for one sequence."""
    order = list(dict.fromkeys(b for n in gm.graph.nodes if n.op != "placeholder" for b in [block_of(n)] if b))
    parts: dict = {b: Part() for b in order}
    outer = Part()

    def part_of(node) -> Part:
        return parts.get(block_of(node), outer)

    keep = _count_ops(gm, parts, outer, part_of)
    for name, p in parts.items():
        _block_inputs(gm, name, p, keep)
    _measure_saved(gm, part_of)
    rep = order[1] if len(order) > 2 else (order[0] if order else None)
    block = parts[rep] if rep is not None else Part()
    params = [v for n in gm.graph.find_nodes(op="placeholder") for v in [n.meta.get("val")]
              if n.meta.get(ROLE) == "param" and isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    return Profile(block, outer, len(order), tuple(order), _hidden(gm, rep),
                   params[0].element_size() if params else 2)


def _hidden(gm, block: str | None) -> int:
    """The last dim of the activation the block reads first (the model's hidden size)."""
    if block is None:
        return 0
    first = next(n for n in gm.graph.nodes if n.op == "call_function" and block_of(n) == block)
    return next((v.shape[-1] for a in first.all_input_nodes for v in [a.meta.get("val")]
                 if isinstance(v, torch.Tensor) and v.dim() >= 3), 0)


def _mm_shape(node, target: str) -> tuple | None:
    """(M, K, N) of a product node."""
    ins = _tensors(node)
    a, b = ((ins[1:3] if target in ("aten.addmm.default", "aten.baddbmm.default") else ins[:2]) + [None] * 2)[:2]
    if a is None or b is None:
        return None
    k = a.shape[-1]
    if target in ("aten.bmm.default", "aten.baddbmm.default") or (target == "aten.matmul.default" and b.dim() > 2):
        v = node.meta["val"]
        return v.numel() // v.shape[-1], k, v.shape[-1]
    return a.numel() // k, k, b.shape[0] if target == "aten.linear.default" else b.shape[-1]


def _count_ops(gm, parts: dict, outer: Part, part_of) -> set:
    """Products, attention, memory-bound traffic and parameters into each part; returns the nodes whose
    outputs per-op selective recomputation keeps (every other product of a part, and attention)."""
    keep: set = set()
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if node.op == "placeholder":
            if node.meta.get(ROLE) == "param" and isinstance(v, torch.Tensor):
                blk = block_path(node.meta.get(PARAM, "") or "")
                parts.get(blk, outer).params += v.numel()
            continue
        if node.op != "call_function":
            continue
        p, target = part_of(node), str(node.target)
        p.largest_output = max(p.largest_output, _bytes(v))
        p.ops += 1
        if target in LINEAR:
            shape = _mm_shape(node, target)
            if shape is not None:
                p.mm.append(shape)
                p.mm_inputs.append(_activation(node))
                if len(p.mm) % 2 == 1:
                    keep.add(node)
        elif target in ATTENTION:
            q, k = _tensors(node)[:2]
            f = 4.0 * q.numel() * k.shape[-2]  # 4 b h s_q d s_k: the score and value products
            p.attention_flops += f * (0.5 if _causal(node) else 1.0)
            p.attention_scores += f / (4.0 * q.shape[-1]) * (0.5 if _causal(node) else 1.0)
            keep.add(node)
        elif isinstance(v, torch.Tensor) and v.dtype.is_floating_point and target not in VIEWS:
            ins = _tensors(node)
            if target in COPIES_IF_STRIDED and ins and ins[0].is_contiguous():
                continue  # a view after all
            reads = 0.0 if target == "aten.embedding.default" else sum(_bytes(t) for t in ins)
            p.memory_bytes += _bytes(v) + reads
    return keep


def _block_inputs(gm, name: str, p: Part, keep: set) -> None:
    """The block's activation input (what full recomputation keeps) and what per-op selective
    recomputation keeps and runs again."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and block_of(n) == name]
    inside = set(nodes)
    outside = [v for n in nodes for a in n.all_input_nodes for v in [a.meta.get("val")]
               if a not in inside and a.meta.get(ROLE) != "param" and a.op != "get_attr"
               and isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dim() >= 3]
    p.input_bytes = max((_bytes(v) for v in outside), default=0.0)
    p.sac_saved = p.input_bytes + sum(_sum_bytes(n.meta.get("val")) for n in nodes if n in keep)
    products = [n for n in nodes if str(n.target) in LINEAR]
    p.sac_recompute_flops = sum(2.0 * m * k * n for (m, k, n), node in zip(p.mm, products) if node not in keep)


def _activation(node) -> str:
    """The activation a product reads, looked through views and casts (q, k and v read one)."""
    x = node.args[1] if str(node.target) in ("aten.addmm.default", "aten.baddbmm.default") else node.args[0]
    while isinstance(x, torch.fx.Node) and (str(x.target) in VIEWS or str(x.target) in COPIES_IF_STRIDED
                                            or str(x.target).startswith(("aten.to.", "aten._to_copy"))):
        x = x.args[0]
    return getattr(x, "name", "")


def _sum_bytes(v) -> float:
    if isinstance(v, (tuple, list)):
        return sum(_bytes(t) for t in v)
    return _bytes(v)


class _Saved(Interpreter):
    """Runs the graph on fake tensors, noting each node's part while it runs."""

    def __init__(self, gm, part_of, note):
        super().__init__(gm)
        self.part_of, self.note, self.current = part_of, note, None

    def run_node(self, n):
        self.current = self.part_of(n)
        if str(n.target) not in ATTENTION:
            return super().run_node(n)
        # a flash kernel saves q, k, v, its output and the fp32 log-sum-exp [b, h, s_q]; whatever this
        # CPU/meta run's kernel saves (the math one keeps the [s, s] scores) is not counted
        part, self.current = self.current, None
        out = super().run_node(n)
        q, k, v = self.fetch_args_kwargs_from_env(n)[0][:3]
        for t in (q, k, v, out):
            self.note(t, part)
        part.saved += q.numel() // q.shape[-1] * 4.0
        return out

    def fetch_attr(self, target):
        v = super().fetch_attr(target)  # a buffer or constant: as a fake tensor on the graph's device
        if isinstance(v, torch.Tensor) and v.is_meta:
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
        return v


def _measure_saved(gm, part_of) -> None:
    """Bytes autograd saves for backward, per part (`part_of(node)`): the graph run once on fake tensors
    (nothing is allocated), each saved storage counted once, in the part whose op saved it first."""
    seen: set[int] = set()
    held: list = []  # every tensor noted stays alive: a freed storage's address (its key) is reused

    def note(t, part):
        key = storage_key(t)
        if key not in seen and part is not None:
            seen.add(key)
            held.append(t)
            part.saved += float(t.untyped_storage().nbytes())

    runner = _Saved(gm, part_of, note)

    def pack(t):
        note(t, runner.current)
        return t

    with fake_tensor_mode(allow_real=True):
        args = []
        for node in gm.graph.find_nodes(op="placeholder"):
            v = node.meta.get("val")
            if not isinstance(v, torch.Tensor):
                args.append(v)
                continue
            grad = node.meta.get(ROLE) == "param" and v.dtype.is_floating_point
            args.append(torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device,
                                            requires_grad=grad))
            if node.meta.get(ROLE) in ("param", "buffer"):  # a weight a linear keeps is not an activation
                seen.add(storage_key(args[-1]))
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            runner.run(*args)
