"""What `autopar.dry_run` records (`autopar.parallel.dry_run`): every call a torch ProcessGroup receives
(`Recorder`, patching the group's methods while active), as a `Collective`; under fake tensors,
autopar's library ops running their eager bodies (`EagerOps`), so that they issue their collectives;
and a rank's training step with the most bytes it keeps saved for backward at once (`train_step`)."""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.overrides import TorchFunctionMode

from autopar.errors import UsageError
from autopar.program.audit import PROCESS_GROUP_METHODS as _METHODS
from passes.compat import TorchDispatchMode, custom_op_body, is_fake, pytree, static_pipeline_warmup, storage_key
from passes.cost.profile import ATTENTION as _ATTENTION
from passes.nodes import source_line
from passes.ops.comm import current_tag

__all__ = ["Collective", "EagerOps", "Recorder", "model_lines", "train_step"]

_OWN = (os.sep + "autopar" + os.sep, os.sep + "passes" + os.sep)


@dataclass(frozen=True)
class Collective:
    """One call a process group received: `op` (the ProcessGroup method), `group` (its global ranks),
    `shapes` and `dtype` of its tensors, `peer` (a broadcast's or reduce's root, a send's destination or
    a receive's source, as a global rank; None otherwise), `where` (autopar's line that issued it),
    `node` (the graph node or other CommLog tag it was issued for)."""

    op: str
    group: tuple
    shapes: tuple
    dtype: str
    peer: int | None
    where: str
    node: str = ""  # the CommLog tag it was issued under: the graph node ('linear_3'), 'pp:send', ...

    def key(self, shapes: bool = True) -> tuple:
        """What the members of a group must agree on: op, dtype, root and shapes; shapes not for an object
        exchange (uint8: a pickle, whose size is the rank's) nor an all-to-all (each rank's splits its own)."""
        exact = shapes and self.dtype != "torch.uint8" and self.op not in ("all_to_all_single", "alltoall_base",
                                                                            "alltoall")
        return (self.op, self.dtype, self.peer) + ((self.shapes,) if exact else ())

    def __str__(self) -> str:
        peer = f" root/peer {self.peer}" if self.peer is not None else ""
        node = f" for {self.node}" if self.node else ""
        return f"{self.op}{list(self.shapes)} {self.dtype}{peer} (from {self.where}{node})"


class EagerOps(TorchDispatchMode):
    """Under a FakeTensorMode, autopar's library ops run their eager bodies (which issue the
    collectives, count them in the grid's CommLog and call the process group) instead of their fake
    kernels, which only give shapes. The checks on values (ids in range, routing) keep their fake
    kernels: fake tensors have no values to check."""

    SHAPES_ONLY = ("check_ids", "check_targets", "moe_offsets", "moe_dispatch", "moe_combine")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "autopar" and func._opname not in self.SHAPES_ONLY:
            with EagerOps():  # ops called inside the body run theirs too
                return custom_op_body(f"autopar::{func._opname}")(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))



class Recorder(contextlib.AbstractContextManager):
    """Records every call of the `_METHODS` of torch's ProcessGroup (patched on the class while active).
    What rank 0 broadcasts as objects (int64 sizes and uint8 pickles: its strategy choice, its arrangement;
    a pipeline stage's first rank, its stage's choice), and what a rank sends another as objects (a
    pipeline stage's output layouts), is kept in `sent` (an `autopar.program.workers.Relay`) and handed,
    in order per channel, to the later simulated ranks that receive it: the fake group moves no data, and
    a rank that decides nothing itself must get the decision it is sent (`missed`: what it received from
    a rank not simulated before it). A pipeline schedule's warm-up vote, whose answer travels back from
    the last stage, is taken as the real run takes it (autopar gives every stage its shapes: torch's
    static mode)."""

    def __init__(self, rank: int, sent, per_stage: int = 0):
        self.calls: list = []
        self.saved: dict = {}
        self.rank, self.sent, self.count = rank, sent, {}
        self.per_stage = per_stage  # ranks per pipeline stage (0: no stages)
        self.done: dict = {}  # method -> the fake group's Work of a call on fake tensors (it moves nothing)
        self.missed: list = []  # (channel, source) of objects received from a rank not simulated before

    def __enter__(self):
        for name in _METHODS:
            orig = getattr(dist.ProcessGroup, name, None)
            if orig is not None:
                # the class's own entry (pybind's instancemethod) is put back, not what getattr returns (the bare
                # function: a later real group's call of it would lose `self`)
                self.saved[name] = dist.ProcessGroup.__dict__.get(name)
                setattr(dist.ProcessGroup, name, self._wrap(name, orig))
        self.restore = static_pipeline_warmup()
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self.saved.items():
            if orig is None:  # inherited: the class had no entry of its own
                delattr(dist.ProcessGroup, name)
            else:
                setattr(dist.ProcessGroup, name, orig)
        self.restore()

    def take(self) -> list:
        out, self.calls = self.calls, []
        return out

    def _wrap(self, name, orig):
        def call(pg, *args, **kwargs):
            c, fake = _record(name, pg, args)
            self.calls.append(c)
            if fake and name in self.done:  # fake tensors: the fake group's call does nothing but return
                return self.done[name]
            work = orig(pg, *_fake_accepts(name, args), **kwargs)
            if fake:
                self.done[name] = work
            if c.dtype in ("torch.int64", "torch.uint8"):
                if name == "broadcast":  # rank 0's decisions; a pipeline stage's, from its first rank
                    self._relay(c.group, c.peer, args[0][0])
                elif name in ("send", "recv"):  # a pipeline stage's layouts, sent to the next stage
                    src, dst = (self.rank, c.peer) if name == "send" else (c.peer, self.rank)
                    self._relay(("p2p", src, dst), src, args[0][0], self._stages(src, dst))
            return work
        return call

    def _stages(self, src: int, dst: int):
        return ("stages", src // self.per_stage, dst // self.per_stage) if self.per_stage else None

    def _relay(self, channel, source: int, t: torch.Tensor, alt=None) -> None:
        """The k-th object tensor on `channel` (a group, or a sender and receiver) from `source`: kept
        when this rank is the source, copied in when it receives and the source was simulated before
        (`autopar.program.workers.Relay`, which waits for it where another worker simulates the source).
        `alt`: the channel between the sender's and the receiver's pipeline stages, whose k-th object
        (what any simulated rank of the one stage sent the next: a stage's layouts, the same at every
        grid position) a receiver takes when its own sender was not simulated."""
        n = self.count.get(channel, 0)
        self.count[channel] = n + 1
        key, other = (channel, n), (alt, n) if alt is not None else None
        if self.rank == source:
            self.sent.put(key, t, other, self.rank)
            return
        got = self.sent.get(key, other, source, self.rank)
        if got is not None and got.shape == t.shape:
            t.copy_(got)
        elif got is None and not is_fake(t):
            self.missed.append((channel, source))


def _fake_accepts(name: str, args: tuple) -> tuple:
    """The fake group refuses an uneven all-to-all whose input is empty (gloo and NCCL take it: a rank that
    sends nothing but receives): it gets a one-element input sent to its first peer, which moves nothing
    under the fake group and changes no recorded shape."""
    if name not in ("alltoall_base", "all_to_all_single") or len(args) < 5 or args[1].numel():
        return args
    if not any(args[2]) or not args[3]:
        return args
    out, inp, out_splits, in_splits, opts = args
    return out, inp.new_zeros(1), out_splits, [1] + [0] * (len(in_splits) - 1), opts


_RANKS: dict = {}  # id(process group) -> (the group, its global ranks)


def _record(name: str, pg, args: tuple) -> tuple:
    """(the Collective of this call, whether its tensors are fake)."""
    known = _RANKS.get(id(pg))
    if known is None or known[0] is not pg:
        known = _RANKS[id(pg)] = (pg, tuple(dist.get_process_group_ranks(pg)))
    ranks = known[1]
    tensors = [t for t in pytree.tree_leaves(list(args)) if isinstance(t, torch.Tensor)]
    peer = None
    opts = args[-1] if args else None
    if name in ("broadcast", "reduce") and hasattr(opts, "rootRank"):
        peer = ranks[opts.rootRank]
    elif name in ("send", "recv") and len(args) > 1 and isinstance(args[1], int):
        peer = ranks[args[1]]
    return (Collective(name, ranks, tuple(tuple(t.shape) for t in tensors),
                       str(tensors[0].dtype) if tensors else "", peer, _caller(), current_tag() or ""),
            bool(tensors) and is_fake(tensors[0]))


_OURS: dict = {}  # code object -> its file's base name where it is autopar's (not the dry run's own), else None


def _caller() -> str:
    """autopar's innermost line on the stack (where the collective was issued)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        name = _OURS.get(code, 0)
        if name == 0:
            own = any(part in code.co_filename for part in _OWN) and not code.co_filename.endswith(
                ("dry_run.py", "recorder.py"))
            name = _OURS[code] = os.path.basename(code.co_filename) if own else None
        if name is not None:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def train_step(pm, args: tuple, kwargs: dict) -> tuple:
    """One training step: forward, backward of the loss, an AdamW step; (the optimizer, the most bytes the
    step's forward passes held saved for backward at once: the storages autograd keeps, each counted once
    while any tensor saved on it lives, parameters and their views left out (an FSDP2 unit's gathered ones
    too: the estimate counts them apart); an attention counted as a flash kernel saves it, as the estimate
    counts it (`passes.cost.profile`): its inputs, its output and the fp32 log-sum-exp per query row and
    head, not the [s, s] scores or mask this CPU run's kernel keeps)."""
    params = {storage_key(p.to_local()) for p in pm.parameters()}

    def gathered(module, args) -> None:  # an FSDP2 unit's parameters, gathered whole for its forward
        params.update(storage_key(p.to_local() if hasattr(p, "to_local") else p) for p in module.parameters())

    hooks = [m.register_forward_pre_hook(gathered) for top in getattr(pm, "stage_modules", [pm])
             for m in top.modules() if isinstance(m, FSDPModule)]
    live: dict = {}  # storage -> [saved tensors alive on it, its bytes]
    held = [0, 0]  # bytes now, most bytes at once

    def release(key) -> None:
        entry = live[key]
        entry[0] -= 1
        if not entry[0]:
            held[0] -= entry[1]
            del live[key]

    def keep(t, extra: int = 0) -> None:
        key = storage_key(t)
        if extra:  # bytes the kernel saves beside t (a log-sum-exp), released with it
            key = (key, "extra")
        if key in live:
            live[key][0] += 1
        else:
            live[key] = [1, extra or t.untyped_storage().nbytes()]
            held[0] += live[key][1]
            held[1] = max(held)
        weakref.finalize(t, release, key)

    attention = _FlashSaves(keep)

    def pack(t):
        base = t if t._base is None else t._base
        if not attention.inside and not isinstance(base, torch.nn.Parameter) and storage_key(t) not in params:
            keep(t)  # a weight (an FSDP unit's gathered one too) is no activation
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), attention:
            if hasattr(pm, "train_step"):  # pipeline stages: the schedule runs forward and backward
                pm.train_step(*args, **kwargs)
            else:
                _loss(pm(*args, **kwargs)).backward()
    finally:
        for h in hooks:
            h.remove()
    opt = torch.optim.AdamW(pm.parameters())
    opt.step()
    return opt, held[1]


class _FlashSaves(TorchFunctionMode):
    """While a scaled-dot-product attention runs, what its kernel saves is not counted; its q, k, v, output
    and log-sum-exp are (`keep`)."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.inside = keep, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) not in _ATTENTION or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        self.inside += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.inside -= 1
        q, k, v = args[:3]
        for t in (q, k, v, out):
            self.keep(t)
        self.keep(out, q.numel() // q.shape[-1] * 4)
        return out


def _loss(out) -> torch.Tensor:
    """The model's own loss (its 0-dim floating-point output), else the mean of its floating outputs'
    local blocks (a stand-in whose backward reaches every parameter)."""
    from autopar.program.loss_share import loss_leaf

    leaves = pytree.tree_leaves(out)
    at = loss_leaf(out)
    if at is not None:
        return leaves[at]
    floats = [t.to_local() if hasattr(t, "to_local") else t for t in leaves
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise UsageError("autopar.dry_run: the model's output has no floating-point tensor to train on")
    return sum(t.float().mean() for t in floats)


def model_lines(pm, calls: list) -> dict:
    """{CommLog tag of `calls`: the line of the user's model its graph node came from} for the programs of
    `pm` (each stage's, for pipeline stages); an edge's tag ('a->b') takes its consumer's line, a gradient
    sync's ('gradsync:x') its node's."""
    nodes: dict = {}
    for m in getattr(pm, "stage_modules", [pm]):
        program = getattr(m, "program", None)
        for gm in (getattr(program, "gm", None), getattr(getattr(program, "captured", None), "gm", None)):
            for n in (gm.graph.nodes if gm is not None else ()):
                nodes.setdefault(n.name, n)
    out: dict = {}
    for tag in {c.node for c in calls if c.node}:
        for name in (tag.split("->")[-1], tag.split("->")[0], tag.split(":")[-1]):
            line = source_line(nodes[name]) if name in nodes else ""
            if line:
                out[tag] = line
                break
    return out
