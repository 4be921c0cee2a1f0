"""Capture: an nn.Module and example inputs -> an aten-level fx GraphModule with every input lifted.

Uses `torch.export.export(strict=False)`, then inlines `torch.no_grad()` / autocast regions
(`passes.capture.regions`) and rewrites in-place ops on intermediate tensors out of place
(`passes.capture.functionalize`), so that rules see plain aten ops. Parameters, buffers and constants
become placeholders; the pass records on each placeholder what it stands for in `node.meta[ROLE]`
('param' | 'buffer' | 'constant' | 'input') and, for parameters, the canonical name (the first name
`named_parameters()` gives a tensor shared by several modules, e.g. a tied embedding) in
`node.meta[PARAM]` (the keys are `passes.meta`'s).

>>> import torch
>>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
>>> [n.meta[ROLE] for n in cap.gm.graph.find_nodes(op="placeholder")]
['param', 'param', 'input']
"""

from __future__ import annotations

import contextlib
import itertools
import os
import traceback
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind

from passes.compat import call_spec, parse_to, pytree
from passes.capture.functionalize import functionalize, keep_parameter_views
from passes.meta import PARAM, ROLE
from passes.capture.regions import inline_regions
from passes.errors import CaptureError, SignatureError



@dataclass
class Captured:
    gm: torch.fx.GraphModule
    sources: list  # per placeholder: (role, key) with key a name or a user-input index
    in_spec: pytree.TreeSpec  # export's call spec: (args, kwargs) of the captured call
    out_spec: pytree.TreeSpec
    constants: dict
    buffers: dict  # canonical name -> tensor (full)
    persistent: set
    device: torch.device = torch.device("cpu")  # where the inputs (and so the shards) live
    context: object = None  # context_parallel: the `passes.transforms.context.ContextPlan` its compile made


def _user_frame(exc: BaseException):
    """The innermost traceback frame outside torch: where the user's (or the model library's) code failed."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    here = os.path.dirname(__file__)
    frames = [f for f in frames if not f.filename.startswith(here) and not f.filename.startswith("<")]
    return frames[-1] if frames else None


@contextlib.contextmanager
def _unchanged_module_to():
    """`self.classifier = self.classifier.to(self.dtype)` inside forward (Switch Transformers, NLLB-MoE):
    export traces with fake parameters, which Module.to always swaps for new ones, and the swap fails
    on them. A .to() that converts no parameter or buffer returns the module untouched, as eager does
    in effect; any other .to() runs as usual."""
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, memory_format = parse_to(*args, **kwargs)
        tensors = itertools.chain(self.parameters(), self.buffers())
        if memory_format is None and all(
                (device is None or t.device == device)
                and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
                for t in tensors):
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def unaliased(args: tuple, kwargs: dict) -> tuple:
    """(args, kwargs) with every tensor that shares its storage with an earlier one (the same tensor
    passed twice, as HF's `labels=input_ids`, or a view of another input) replaced by a copy. Export
    traces a graph for the inputs as given: with one tensor in two places it may read either
    placeholder for both (the embedding reading `labels`), and a later call whose two inputs differ
    would silently compute on the wrong one."""
    seen: set = set()

    def own(t):
        if not isinstance(t, torch.Tensor):
            return t
        try:
            key = ("storage", t.untyped_storage().data_ptr()) if t.device.type != "meta" else ("id", id(t))
        except (RuntimeError, NotImplementedError):  # a tensor without storage (fake, functional)
            key = ("id", id(t))
        if key[1] == 0:  # an empty storage: nothing to share
            key = ("id", id(t))
        if key in seen:
            return t.clone()
        seen.add(key)
        return t
    return pytree.tree_map(own, (tuple(args), dict(kwargs)))


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Captured:
    args, kwargs = unaliased(args, kwargs or {})
    try:
        with _unchanged_module_to():
            ep = torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as e:  # re-raised with the user's line; the original stays chained
        frame = _user_frame(e)
        where = f"{frame.filename}:{frame.lineno}: `{frame.line}`" if frame else "(no frame outside torch)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {first}\n"
            f"  failing line: {where}\n"
            f"  What to try: data-dependent Python control flow (`if tensor.sum() > 0:`, `.item()`, "
            f"`.tolist()`) cannot be traced; rewrite it with torch.where / torch.cond, or move it out of "
            f"forward(). Generation caches must be off (use_cache=False)."
        ) from e

    canonical: dict[int, str] = {}  # id(parameter) -> its first name
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    buffers = dict(model.named_buffers())
    sig = ep.graph_signature
    gm = functionalize(inline_regions(ep.graph_module))
    placeholders = gm.graph.find_nodes(op="placeholder")
    sources: list[tuple[str, str | int]] = []  # per placeholder: (role, name or user-input index)
    user_i, persistent = 0, set()
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.PARAMETER:
            name = canonical[id(model.get_parameter(spec.target))]
            node.meta.update({ROLE: "param", PARAM: name})
            sources.append(("param", name))
        elif spec.kind == InputKind.BUFFER:
            node.meta[ROLE] = "buffer"
            sources.append(("buffer", spec.target))
            if spec.persistent:
                persistent.add(spec.target)
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            node.meta[ROLE] = "constant"
            sources.append(("constant", spec.target))
        else:
            node.meta[ROLE] = "input"
            sources.append(("input", user_i))
            user_i += 1
    keep_parameter_views(gm)
    for node in gm.graph.nodes:  # drop export's runtime assertions on input metadata
        if node.op == "call_function" and node.target in (
            torch.ops.aten._assert_tensor_metadata.default,
        ) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    in_spec, out_spec = call_spec(ep)
    return Captured(
        gm=gm,
        sources=sources,
        in_spec=in_spec,
        out_spec=out_spec,
        constants=dict(ep.constants),
        buffers={k: buffers[k] for k in sig.buffers},
        persistent=persistent,
    )


def retarget_meta(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """A model built on the meta device bakes device='meta' into the ops that create tensors (arange,
    to, ...); point them at the device the shards will live on."""
    meta = torch.device("meta")

    def fix(a):
        return device if isinstance(a, torch.device) and a == meta else a

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, fix)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
    gm.recompile()


def flatten_inputs(captured: Captured, args: tuple, kwargs: dict | None) -> list:
    """The user inputs in placeholder order; kwargs may come in any order."""
    kwargs = kwargs or {}
    spec_kwargs = captured.in_spec.child(1).context if captured.in_spec.num_children == 2 else []
    unknown = set(kwargs) - set(spec_kwargs)
    missing = set(spec_kwargs) - set(kwargs)
    if unknown or missing:
        raise SignatureError(
            f"the parallel model was captured with keyword arguments {sorted(spec_kwargs)} but was called "
            f"with {sorted(kwargs)}; pass the same keywords as example_kwargs had"
        )
    flat, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in spec_kwargs}))
    if spec != captured.in_spec:
        want = captured.in_spec.child(0).num_children if captured.in_spec.num_children == 2 else "?"
        raise SignatureError(
            f"the parallel model was captured with {want} positional input(s) (and keywords {sorted(spec_kwargs)}) "
            f"but was called with {len(args)} positional input(s) of another structure; call it the way "
            f"example_inputs / example_kwargs were given (same positions, same nesting)"
        )
    return flat


@contextlib.contextmanager
def no_stack_traces():
    """FX tracing (torch.export) inside it records no stack trace per node (torch.fx.config's
    `do_not_emit_stack_traces`): for a trace whose nodes no message ever names. Checked on 2.13.0; where
    a torch lacks the switch, traces keep their stack traces (slower, nothing else)."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before
