"""What `autopar.dry_run` records (`autopar.parallel.dry_run`): every call a torch ProcessGroup receives
(`Recorder`, patching the group's methods while active), as a `Collective`; and, under fake tensors,
autopar's library ops running their eager bodies (`EagerOps`), so that they issue their collectives."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from passes.compat import TorchDispatchMode, custom_op_body, is_fake, pytree, static_pipeline_warmup

__all__ = ["Collective", "EagerOps", "Recorder"]

# the ProcessGroup methods torch.distributed's functions call (torch 2.13), each recorded as it is called
_METHODS = ("broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather", "allgather_coalesced",
            "all_gather_single", "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
            "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter",
            "send", "recv", "barrier")
_OWN = (os.sep + "autopar" + os.sep, os.sep + "passes" + os.sep)


@dataclass(frozen=True)
class Collective:
    """One call a process group received: `op` (the ProcessGroup method), `group` (its global ranks),
    `shapes` and `dtype` of its tensors, `peer` (a broadcast's or reduce's root, a send's destination or
    a receive's source, as a global rank; None otherwise), `where` (autopar's line that issued it)."""

    op: str
    group: tuple
    shapes: tuple
    dtype: str
    peer: int | None
    where: str

    def key(self, shapes: bool = True) -> tuple:
        """What the members of a group must agree on: op, dtype, root and shapes; shapes not for an object
        exchange (uint8: a pickle, whose size is the rank's) nor an all-to-all (each rank's splits its own)."""
        exact = shapes and self.dtype != "torch.uint8" and self.op not in ("all_to_all_single", "alltoall_base",
                                                                            "alltoall")
        return (self.op, self.dtype, self.peer) + ((self.shapes,) if exact else ())

    def __str__(self) -> str:
        peer = f" root/peer {self.peer}" if self.peer is not None else ""
        return f"{self.op}{list(self.shapes)} {self.dtype}{peer} (from {self.where})"


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
    What rank 0 broadcasts as objects (int64 sizes and uint8 pickles: its strategy choice, its arrangement),
    and what a rank sends another as objects (a pipeline stage's output layouts), is kept in `sent` and
    handed, in order per channel, to the later simulated ranks that receive it: the fake group moves no
    data, and a rank that decides nothing itself must get the decision it is sent. A pipeline schedule's
    warm-up vote, whose answer travels back from the last stage, is taken as the real run takes it
    (autopar gives every stage its shapes: torch's static mode)."""

    def __init__(self, rank: int, sent: dict, per_stage: int = 0):
        self.calls: list = []
        self.saved: dict = {}
        self.rank, self.sent, self.count = rank, sent, {}
        self.per_stage = per_stage  # ranks per pipeline stage (0: no stages)
        self.done: dict = {}  # method -> the fake group's Work of a call on fake tensors (it moves nothing)

    def __enter__(self):
        for name in _METHODS:
            orig = getattr(dist.ProcessGroup, name, None)
            if orig is not None:
                self.saved[name] = orig
                setattr(dist.ProcessGroup, name, self._wrap(name, orig))
        self.restore = static_pipeline_warmup()
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self.saved.items():
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
                if name == "broadcast" and c.peer == 0:
                    self._relay(c.group, 0, args[0][0])
                elif name in ("send", "recv"):  # a pipeline stage's layouts, sent to the next stage
                    src, dst = (self.rank, c.peer) if name == "send" else (c.peer, self.rank)
                    self._relay(("p2p", src, dst), src, args[0][0], self._stages(src, dst))
            return work
        return call

    def _stages(self, src: int, dst: int):
        return ("stages", src // self.per_stage, dst // self.per_stage) if self.per_stage else None

    def _relay(self, channel, source: int, t: torch.Tensor, alt=None) -> None:
        """The k-th object tensor on `channel` (a group, or a sender and receiver) from `source`: kept
        when this rank is the source, copied in when it receives and the source was simulated before.
        `alt`: the channel between the sender's and the receiver's pipeline stages, whose k-th object
        (what any simulated rank of the one stage sent the next: a stage's layouts, the same at every
        grid position) a receiver takes when its own sender was not simulated."""
        n = self.count.get(channel, 0)
        self.count[channel] = n + 1
        key, other = (channel, n), (alt, n) if alt is not None else None
        if self.rank == source:
            self.sent[key] = t.detach().clone()
            if other is not None:
                self.sent.setdefault(other, self.sent[key])
            return
        got = self.sent.get(key, self.sent.get(other) if other is not None else None)
        if got is not None and got.shape == t.shape:
            t.copy_(got)


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
                       str(tensors[0].dtype) if tensors else "", peer, _caller()),
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
