"""`autopar.audit_devices()`: find, without a GPU, the tensors autopar would hand NCCL from the host.

On a GPU node NCCL takes only tensors on the GPU: a tensor made on the CPU and passed to a collective fails
there ("No backend type associated with device type cpu"), although the same code runs under gloo on a
CPU-only machine, where every tensor is on the CPU. While the audit is active:

- every tensor that a torch factory function (`torch.zeros`, `torch.tensor`, `torch.arange`, ...) makes
  without a `device` (and with the CPU as torch's default device), or that `.cpu()` makes, in autopar's own
  code (`autopar/`, `passes/`; `roots` widens it), is marked as made on the host;
- what is computed from a marked tensor is marked too, until `.to(...)` moves it (here every device is the
  CPU, so a move to the model's device and one to the host look alike: `.to` clears the mark);
- every call a torch ProcessGroup receives is checked: a marked tensor among its tensors is a `Finding`,
  naming the collective, the tensor, the line that made it and the line that issued the call.

    with autopar.audit_devices() as audit:
        loss = pmodel.train_step(ids, labels=ids)
    assert not audit.findings, audit.findings

Tensors torch itself makes for its own collectives (the pickles of an object collective, FSDP2's and the
pipeline schedule's buffers) are made on the device torch chooses for the group and are not marked.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from passes.compat import pytree

__all__ = ["PROCESS_GROUP_METHODS", "DeviceAudit", "Finding", "audit_devices", "package_dirs"]

# the ProcessGroup methods torch.distributed's functions call (torch 2.13; 2.11's single-tensor gather and
# scatter call the `_base` ones)
PROCESS_GROUP_METHODS = (
    "broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather", "allgather_coalesced",
    "all_gather_single", "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter",
    "send", "recv", "barrier", "_allgather_base", "_reduce_scatter_base", "allgather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced")
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange,
              torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace, torch.scalar_tensor,
              torch.empty_strided}
_TORCH = os.sep + "torch" + os.sep


def package_dirs() -> tuple:
    """The source folders of autopar's own code: `autopar/` and `passes/`."""
    import passes

    return (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
            os.path.dirname(os.path.abspath(passes.__file__)) + os.sep)


@dataclass(frozen=True)
class Finding:
    """A tensor made on the host handed to a collective: `op` (the ProcessGroup method), the tensor's
    shape and dtype, `made` (the line that made it on the host) and `issued` (autopar's line that called
    the collective)."""

    op: str
    shape: tuple
    dtype: str
    made: str
    issued: str

    def __str__(self) -> str:
        return (f"{self.op} of a {list(self.shape)} {self.dtype} tensor made on the host at {self.made} "
                f"(issued at {self.issued}): NCCL refuses it; make it on the model's device")


class DeviceAudit(TorchFunctionMode):
    """See the module docstring; `findings` lists what was found, in order."""

    def __init__(self, roots: tuple = ()):
        super().__init__()
        self.roots = package_dirs() + tuple(roots)
        self.findings: list = []
        self._made: dict = {}  # id(tensor) -> (weakref, the line that made it on the host)
        self._saved: dict = {}

    # -- marks
    def _ours(self) -> str | None:
        """autopar's line (or a root's) that the current call came from, if the first frame outside torch and
        this module is one; else None."""
        frame = sys._getframe(2)
        while frame is not None and (_TORCH in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.roots):
            return None
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"

    def _mark(self, out, line: str) -> None:
        import weakref

        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = (weakref.ref(t), line)

    def made(self, t) -> str | None:
        """Where `t` was made on the host, if it was (while this audit ran)."""
        entry = self._made.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            given = args[0] if args else kwargs.get("data")
            if kwargs.get("device") is None and torch.get_default_device().type == "cpu" \
                    and not isinstance(given, torch.Tensor):  # as_tensor(t) is t, on t's device
                line = self._ours()
                if line is not None:
                    self._mark(out, line)
            return out
        if func is torch.Tensor.cpu:
            line = self._ours()
            if line is not None:
                self._mark(out, line)
            return out
        if func is torch.Tensor.to and _target_device(args[1:], kwargs) is not None:
            self._made.pop(id(out), None)  # moved to a device (here the same tensor, already on it): unmarked
            return out
        origin = next((m for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                       for m in [self.made(t)] if m is not None), None)
        if origin is not None:
            self._mark(out, origin)
        return out

    # -- the collectives
    def __enter__(self):
        super().__enter__()
        for name in PROCESS_GROUP_METHODS:
            orig = getattr(dist.ProcessGroup, name, None)
            if orig is not None:
                self._saved[name] = dist.ProcessGroup.__dict__.get(name)  # the class's own entry, put back as it was
                setattr(dist.ProcessGroup, name, self._wrap(name, orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            if orig is None:
                delattr(dist.ProcessGroup, name)
            else:
                setattr(dist.ProcessGroup, name, orig)
        self._saved.clear()
        return super().__exit__(*exc)

    def _wrap(self, name: str, orig):
        audit = self

        def call(group, *args, **kwargs):
            for t in pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, torch.Tensor)):
                made = audit.made(t) if isinstance(t, torch.Tensor) else None
                if made is not None:
                    audit.findings.append(Finding(name, tuple(t.shape), str(t.dtype), made, audit._issuer()))
            return orig(group, *args, **kwargs)
        return call

    def _issuer(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename == __file__
                                     or not frame.f_code.co_filename.startswith(self.roots)):
            frame = frame.f_back
        return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(...)` call moves to, if it names one."""
    for a in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):  # .to(other): other's device
            return a.device
    return None


@contextlib.contextmanager
def audit_devices(roots: tuple = ()):
    """A `DeviceAudit` active for the block (see the module docstring): its `findings` name every tensor made on
    the host that reached a collective. `roots`: more source folders to treat as autopar's (a test's own)."""
    audit = DeviceAudit(tuple(os.path.abspath(r) + os.sep for r in roots))
    with audit:
        yield audit
