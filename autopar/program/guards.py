"""Checks that keep ranks in step and inputs honest: options and plans compared across ranks
before anything can hang, inputs compared by a hash of their bytes, and dtype mistakes named where
they are made instead of failing deep inside a matmul."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import re

import torch
import torch.distributed as dist

from autopar.program.consensus import all_gather_objects
from passes.meta import PLAN_ARGS
from passes.ops import comm
from autopar.errors import UsageError


def _plan_text(comp, layouts: dict) -> str:
    """The program's code and parameter layouts, with the sizes grid position (0, 0) bakes where this
    rank's torch.chunk blocks differ (`PLAN_ARGS`), so every rank of one plan writes the same text. Read
    from the flat graph (`Compiled.inspected`): with recompute=..., the regions `gm` runs are modules
    whose nodes were copied without that mark."""
    gm = comp.inspected
    graph = gm.graph
    swapped = [(n, n.args) for n in graph.nodes if PLAN_ARGS in n.meta]
    for n, _ in swapped:
        n.args = n.meta[PLAN_ARGS]
    try:
        code = graph.python_code(root_module="self").src if swapped else gm.code
    finally:
        for n, args in swapped:
            n.args = args
    lines = code.splitlines()
    lines += [f"param {n}: {lay}" for n, lay in sorted(layouts.items())]
    return "\n".join(lines)


@contextlib.contextmanager
def handshake(what: str):
    """A collective of parallelize itself (before the grid exists) that fails or times out."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise comm.CollectiveError(
            f"autopar: {what} failed on rank {dist.get_rank()}: {first}\n  A peer rank has "
            f"probably exited, crashed or not called parallelize; every rank must call it with the same "
            f"arguments. These handshakes wait up to the process group's timeout (init_process_group(timeout=...))."
        ) from e


def _gather(obj, what: str, group=None) -> list:
    return all_gather_objects(obj, group, handshake(what))


def agree_on_options(grid: tuple, options, device_type: str) -> None:
    """Every rank must pass the same grid, `passes.options.Options` and device type; otherwise their
    collectives would not match (a different grid would not even build the same process groups).
    Compared before anything else, over all ranks, by the repr of each value; raises the same
    UsageError on every rank, naming the first option that differs."""
    mine = {k: repr(v) for k, v in [("grid", grid), *options.items(), ("device type", device_type)]}
    everyone = _gather(mine, "comparing parallelize options between ranks")
    for key in mine:
        values = [e.get(key) for e in everyone]
        if len(set(values)) > 1:
            where = ", ".join(f"rank {r}: {key}={v}" for r, v in enumerate(values) if v != values[0])
            raise UsageError(
                f"ranks called parallelize with different {key}: rank 0: {key}={values[0]}, {where}. Every rank "
                f"must pass the same grid and options (they decide which collectives run, and ranks that "
                f"disagree would hang or fail later)"
            )


def agree_on_plan(comp, layouts: dict, model=None, group=None) -> None:
    """Every rank must have built the same plan, from the same model; otherwise their collectives would
    not match and the job would hang later. The plan's text holds the shape and dtype of every
    parameter and buffer of `model`, so a model of other sizes on one rank is caught here even where
    the graph's code reads the same. Raises on every rank, naming the first difference. `group`: the
    ranks that run this plan (None: all; a pipeline stage's ranks run its own)."""
    text = _plan_text(comp, layouts)
    if model is not None:
        text += "".join(f"\ntensor {n}: {tuple(t.shape)} {t.dtype}" for n, t in
                        [*model.named_parameters(remove_duplicate=False), *model.named_buffers()])
    digest = hashlib.sha256(text.encode()).hexdigest()
    digests = _gather(digest, "comparing plans between ranks", group)
    if len(set(digests)) == 1:
        return
    texts = _gather(text, "comparing plans between ranks", group)
    index = next(r for r, d in enumerate(digests) if d != digests[0])
    first, other = (0, index) if group is None else (dist.get_global_rank(group, 0), dist.get_global_rank(group, index))
    a, b = texts[0].splitlines(), texts[index].splitlines()
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    raise UsageError(
        f"ranks built different plans: rank {other} differs from rank {first} at plan line {i + 1}:\n"
        f"  rank {first}:       {a[i].strip() if i < len(a) else '<end>'}\n"
        f"  rank {other}: {b[i].strip() if i < len(b) else '<end>'}\n"
        f"Every rank must call parallelize with the same model and example inputs of the same shapes and "
        f"options (the inputs are full tensors, identical on every rank)." + _reordered_hint(a, b)
    )


def _reordered_hint(a: list, b: list) -> str:
    """The same ops in another order: the model's Python code ran in a per-process order."""
    ops = [collections.Counter(re.findall(r"torch\.ops\.[\w.]+", "\n".join(x))) for x in (a, b)]
    if len(a) != len(b) or ops[0] != ops[1]:
        return ""
    return ("\nBoth ranks hold the same ops in a different order: the model's Python code ran in a per-process "
            "order, typically by iterating over a set of strings, whose order Python's hash randomization "
            "changes in every process (ModernBERT's rotary layer types do). Start every rank with the same "
            "PYTHONHASHSEED, e.g. `PYTHONHASHSEED=0 torchrun ...`.")


def check_dtypes(first, flat: list) -> None:
    """An input of another floating dtype, or an integer where a float was captured (or the reverse),
    is a mistake, not a new shape; other integer dtypes (int32 ids for int64) just compile anew."""
    inputs = [n for n, (role, _) in zip(first.gm.graph.find_nodes(op="placeholder"), first.captured.sources)
              if role == "input"]
    for i, (t, node) in enumerate(zip(flat, inputs)):
        want = getattr(node.meta.get("val"), "dtype", None)
        if not isinstance(t, torch.Tensor) or want is None or t.dtype == want:
            continue
        if t.is_floating_point() or want.is_floating_point:
            raise UsageError(
                f"input {i} is {t.dtype}, but the model was parallelized with {want} for it; cast the input "
                f"(torch.autocast handles mixed precision), or parallelize with an example of that dtype"
            )


_FLOAT_OPS = {"linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "conv1d", "conv2d", "conv3d", "layer_norm",
              "rms_norm", "scaled_dot_product_attention"}


def check_mixed_dtypes(gm: torch.fx.GraphModule) -> None:
    """An integer tensor meeting floating weights in a matmul (say, token ids passed to a model that
    expects features) traces, then fails at run time with a bare dtype error: name it now."""
    from passes.nodes import module_path, source_line

    for n in gm.graph.nodes:
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", None)
        if n.op != "call_function" or name not in _FLOAT_OPS:
            continue
        vals = [a.meta.get("val") for a in n.args if isinstance(a, torch.fx.Node)]
        dtypes = [v.dtype for v in vals if isinstance(v, torch.Tensor)]
        ints = [d for d in dtypes if not d.is_floating_point and not d.is_complex and d != torch.bool]  # bool: masks
        if ints and any(d.is_floating_point for d in dtypes):
            where = " ".join(x for x in (f"in module {module_path(n)}" if module_path(n) else "",
                                         f"at {source_line(n)}" if source_line(n) else "") if x)
            raise UsageError(
                f"aten.{name} {where} mixes dtypes {[str(d) for d in dtypes]}: an integer tensor meets floating "
                f"weights. Pass floating inputs where the model expects features (x.float()), or ids where "
                f"it expects ids; the example inputs decide the dtypes the model is compiled for"
            )


def fingerprint(t) -> str:
    """Shape, dtype and a hash of the bytes: reordered data differs, identical data (NaN included) agrees."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    data = t.detach().to("cpu").contiguous()
    digest = hashlib.sha256(data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() if data.numel() else ""
    return f"{tuple(t.shape)} {t.dtype} {digest}"


def position_checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on `t`'s device: the sum of `t`'s bit patterns (read as ints of its element
    size), each mixed with its flat position, so reordered rows differ where a plain sum agrees.
    Equal tensors agree, NaNs included; it never leaves the device (no host copy of the data)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    flat = t.detach().contiguous().reshape(-1)
    if t.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    if bits is None or not flat.numel():
        return torch.zeros((), dtype=torch.int64, device=t.device)
    x = flat.view(bits).to(torch.int64)
    x = x ^ (x >> 29)  # spread the high bits of a float's pattern into the low ones
    pos = torch.arange(flat.numel(), dtype=torch.int64, device=t.device)
    return (x * (2 * pos + 1) + pos * 0x2545F491).sum()  # int64 arithmetic wraps alike on every rank


def bit_sum(t: torch.Tensor) -> int:
    """The int64 sum of `t`'s bit patterns (read as ints of its element size): a checksum at memory
    speed. Equal tensors agree (NaNs included); a changed element changes it (but for a wrap-around
    collision)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    flat = t.detach().contiguous().reshape(-1)
    if bits is None or not flat.numel():
        return 0
    return int(flat.view(bits).sum(dtype=torch.int64))
