"""Collectives over one mesh axis that count the bytes they receive, and their autograd wrappers.

Every collective the compiled graph runs goes through this module, so `Grid.log` holds the exact
traffic of a step. Tensors are local blocks; `axis` names the mesh axis the collective runs over
(see `passes.mesh`). The autograd wrappers keep one invariant, the one the whole engine relies on:
the gradient of a local block is the block of the global gradient with the same placement
(a replicated tensor's gradient is the full gradient, identical on every member of the group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from passes.compat import all_gather_single, reduce_scatter_single
from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, broadcast_bytes, reduce_bytes, reduce_scatter_bytes
from passes.layout import chunk_range
from passes.ops import flight
from passes.mesh import Grid
from passes.errors import CollectiveError



_TAGS: list = []  # the tags of the collectives being issued now, innermost last (`current_tag`)
_PROFILED = [False]  # `profiled`: each collective a named torch.profiler range
_NO_RANGE = contextlib.nullcontext()  # reentrant and stateless: one for every collective outside a report


@contextlib.contextmanager
def profiled():
    """Within: every collective autopar issues runs inside a torch.profiler range named
    'autopar::comm <op> <tag>' (a step report, `autopar.debug.report`, attributes time to it)."""
    was, _PROFILED[0] = _PROFILED[0], True
    try:
        yield
    finally:
        _PROFILED[0] = was


def current_tag() -> str | None:
    """The CommLog tag (the graph node, 'pp:send', 'fsdp:all-gather', ...) of the collective being issued
    now, for `autopar.dry_run`'s record of where each call came from; None outside one."""
    return _TAGS[-1] if _TAGS else None


@contextlib.contextmanager
def guarded(grid: Grid, what: str, axis, tag: str, tensor: torch.Tensor | None = None, waiting: bool = False):
    """Turn a backend failure into an error that says which collective, where, and what it means, with the
    hang diagnosis of `passes.ops.flight` (which notes every call made inside this: `tensor`, the one it
    moves, for its shape and dtype; `waiting`, a wait for a collective launched before)."""
    _TAGS.append(tag)
    call = flight.record(grid, what, axis, tag, tensor, waiting)
    done = False
    # a named range only inside a step report (`profiled`); otherwise nothing built per collective
    ranged = torch.profiler.record_function(f"autopar::comm {'wait-for-' if waiting else ''}{what} {tag}") \
        if _PROFILED[0] else _NO_RANGE
    try:
        with ranged:
            yield
        done = True
    except CollectiveError:
        raise
    except RuntimeError as e:
        if not _from_backend(e):  # a local error (autograd, shapes) is not a peer's failure: say it as is
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        diagnosis = flight.diagnose(call, _window_s(grid))  # while the call still shows as in progress
        raise CollectiveError(
            f"autopar: {what} over mesh axis {axis} for {tag!r} failed on rank {grid.rank} "
            f"(grid position r={grid.r}, c={grid.c}): {first}\n  A peer rank has probably exited, crashed or "
            f"stopped calling the model (ranks must run the same steps); look at the other ranks' logs. "
            f"parallelize(..., timeout=seconds) bounds how long a stuck collective waits."
            + (f"\n  {diagnosis}" if diagnosis else "")
        ) from e
    finally:  # whatever left the block (any exception too): no longer in progress, so never taken for a hang
        call.state = "done" if done else "failed"
        _TAGS.pop()


def _window_s(grid: Grid) -> float:
    """How long before this failure another rank's report can have been written and still belong to it: the
    grid's collective timeout (at most 10 minutes), and the wait for reports."""
    timeout = getattr(grid, "timeout", None)
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 60.0
    return min(seconds, 600.0) + 2 * flight.REPORT_WAIT_S


_BACKEND_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "socket", "peer", "abort", "store")


def _from_backend(e: RuntimeError) -> bool:
    """A failure of the collective itself (a peer gone, a timeout), as opposed to a local error that
    surfaced inside the call (gloo reports the former as plain RuntimeErrors naming its transport)."""
    return isinstance(e, dist.DistError) or any(w in str(e).lower() for w in _BACKEND_WORDS)


def wait(work, grid: Grid, what: str, axis, tag: str) -> None:
    with guarded(grid, what, axis, tag, waiting=True):
        work.wait()


@dataclasses.dataclass(frozen=True)
class Posted:
    """Collectives launched and not yet waited for, and what their result is once they are done.
    `works`: (work handle, what, axis) in launch order; `finish()`: the result, valid only after every
    handle is waited for; `inputs`: tensors the collectives read or write, kept alive until then."""

    grid: Grid
    tag: str
    works: list
    finish: Callable[[], torch.Tensor]
    inputs: tuple = ()

    def wait(self) -> torch.Tensor:
        """Wait for every collective (a failure raised as `CollectiveError`), then the result."""
        for work, what, axis in self.works:
            wait(work, self.grid, what, axis, self.tag)
        return self.finish()


def in_turn(steps: int, post: Callable, ahead: bool):
    """Each step's operands in order: `post(i)` launches step i's transfers, returning what waits and gives them;
    with `ahead`, step i + 1 is posted before step i is yielded (double buffering), else after its consumer."""
    pending = post(0)
    for i in range(steps):
        value, more = pending(), i + 1 < steps
        if ahead and more:
            pending = post(i + 1)
        yield value
        if more and not ahead:
            pending = post(i + 1)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast(grid: Grid, axis: int, t: torch.Tensor, src: int, tag: str, phase: str, async_op=False):
    """Broadcast `t` (in place) from group member `src`; returns the work handle if async."""
    if grid.index(axis) != src:
        grid.log.add(tag, phase, broadcast_bytes(tensor_bytes(t)))
    grid.log.launch(tag, phase)
    with guarded(grid, "broadcast", axis, tag, t):
        return dist.broadcast(t, src=grid.global_rank(axis, src), group=grid.group(axis), async_op=async_op)


def reduce(grid: Grid, axis: int, t: torch.Tensor, dst: int, tag: str, phase: str, async_op=False):
    """Sum `t` (in place) onto group member `dst`; the other members' `t` is left unspecified."""
    if grid.index(axis) == dst:
        grid.log.add(tag, phase, reduce_bytes(tensor_bytes(t), grid.size(axis)))
    grid.log.launch(tag, phase)
    with guarded(grid, "reduce", axis, tag, t):
        return dist.reduce(t, dst=grid.global_rank(axis, dst), group=grid.group(axis), async_op=async_op)


def exchange(grid: Grid, axis: int, sends: list, recvs: list, tag: str, phase: str) -> Posted | None:
    """Point-to-point traffic of one step over mesh `axis` (`passes.ops.ring`), launched as one batch:
    `sends` and `recvs`, (group member, tensor) pairs; the received buffers' bytes count as received.
    One launch per batch; None when there is nothing to move. Wait for the `Posted` before reading a
    buffer (its `finish` gives nothing)."""
    if not sends and not recvs:
        return None
    group = grid.group(axis)
    ops = [dist.P2POp(dist.isend, t, grid.global_rank(axis, m), group) for m, t in sends]
    for m, buf in recvs:
        grid.log.add(tag, phase, tensor_bytes(buf))
        ops.append(dist.P2POp(dist.irecv, buf, grid.global_rank(axis, m), group))
    grid.log.launch(tag, phase)
    with guarded(grid, "send/recv", axis, tag):
        works = dist.batch_isend_irecv(ops)
    return Posted(grid, tag, [(w, "send/recv", axis) for w in works], lambda: torch.empty(0),
                  tuple(op.tensor for op in ops))


def all_gather(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
               full: int | None = None) -> torch.Tensor:
    """Concatenate the group members' blocks along `dim` (traceable: `passes.ops.library`). `full`: the
    gathered size when the members hold torch.chunk blocks of unequal sizes (a dim the group does not
    divide): each block is padded to the largest, and since only the last non-empty block is short, the
    result is the first `full`."""
    if grid.size(axis) == 1:
        return t.contiguous()
    if full is not None and full % grid.size(axis):
        block = -(-full // grid.size(axis))
        gathered = torch.ops.autopar.all_gather(_pad(t, dim, block), grid.key, axis, dim, tag, phase)
        return gathered.narrow(dim, 0, full).contiguous()
    return torch.ops.autopar.all_gather(t, grid.key, axis, dim, tag, phase)


def _count(grid: Grid, tag: str, phase: str, nbytes: int, received: list | None) -> None:
    """Log one call under `tag` and the bytes it receives: `nbytes` under `tag`, or, for a call shared
    by several ops (`passes.ops.summa_group`), each op's (tag, bytes) of `received`."""
    for t, n in received or [(tag, nbytes)]:
        grid.log.add(t, phase, n)
    grid.log.launch(tag, phase)


def run_all_gather(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
                   received: list | None = None) -> torch.Tensor:
    """`all_gather` now, on a group of more than one member: the body of its torch.library op."""
    return _launch_all_gather(grid, axis, t, dim, tag, phase, received, async_op=False).finish()


def post_all_gather(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
                    full: int | None = None) -> Posted:
    """`all_gather` launched and not waited for (inside an op that waits for it itself: SUMMA's all-gather
    lowering posts both panels' gathers before waiting for either); the same padding, bytes and launch."""
    if grid.size(axis) == 1:
        return Posted(grid, tag, [], t.contiguous)
    if full is not None and full % grid.size(axis):
        padded = _pad(t, dim, -(-full // grid.size(axis)))
        posted = _launch_all_gather(grid, axis, padded, dim, tag, phase, None, async_op=True)
        return dataclasses.replace(posted, finish=lambda: posted.finish().narrow(dim, 0, full).contiguous())
    return _launch_all_gather(grid, axis, t, dim, tag, phase, None, async_op=True)


def _launch_all_gather(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
                       received: list | None, async_op: bool) -> Posted:
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((grid.size(axis) * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    _count(grid, tag, phase, all_gather_bytes(tensor_bytes(t), grid.size(axis)), received)
    with guarded(grid, "all-gather", axis, tag, moved):
        work = all_gather_single(out, moved, group=grid.group(axis), async_op=async_op)
    works = [(work, "all-gather", axis)] if async_op else []  # below: the layout later views expect
    return Posted(grid, tag, works, lambda: out.movedim(0, dim).contiguous(), (moved, out))


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `size`."""
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def reduce_scatter(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str) -> torch.Tensor:
    """Sum the members' `t` and keep this member's block of `dim` (traceable: `passes.ops.library`; its
    torch.chunk block when the group does not divide `dim`: `t` is padded to a multiple, the padding
    then cut off)."""
    if grid.size(axis) == 1:
        return t.contiguous()
    padded, cut = _chunk_padding(grid, axis, t, dim)
    return cut(torch.ops.autopar.reduce_scatter(padded, grid.key, axis, dim, tag, phase))


def _chunk_padding(grid: Grid, axis: int, t: torch.Tensor, dim: int) -> tuple:
    """(`t` padded with zeros along `dim` to a multiple of `axis`'s group size, the function that cuts
    this member's torch.chunk block out of a reduce-scatter of it): `t` and the identity when the group
    divides `dim`."""
    q, size = grid.size(axis), t.shape[dim]
    if size % q == 0:
        return t, lambda out: out
    lo, hi = chunk_range(size, q, grid.index(axis))
    return _pad(t, dim, -(-size // q) * q), lambda out: out.narrow(dim, 0, hi - lo).contiguous()


def run_reduce_scatter(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
                       received: list | None = None) -> torch.Tensor:
    """`reduce_scatter` now, on a group of more than one member: the body of its torch.library op."""
    return _launch_reduce_scatter(grid, axis, t, dim, tag, phase, received, async_op=False).finish()


def post_reduce_scatter(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
                        received: list | None = None) -> Posted:
    """`reduce_scatter` launched and not waited for (from the body of an op that waits for it in another
    op: `passes.ops.overlap`); the same padding of torch.chunk blocks, bytes and launch."""
    if grid.size(axis) == 1:
        return Posted(grid, tag, [], t.contiguous)
    padded, cut = _chunk_padding(grid, axis, t, dim)
    posted = _launch_reduce_scatter(grid, axis, padded, dim, tag, phase, received, async_op=True)
    return dataclasses.replace(posted, finish=lambda: cut(posted.finish()))


def _launch_reduce_scatter(grid: Grid, axis: int, t: torch.Tensor, dim: int, tag: str, phase: str,
                           received: list | None, async_op: bool) -> Posted:
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // grid.size(axis),) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    _count(grid, tag, phase, reduce_scatter_bytes(tensor_bytes(t), grid.size(axis)), received)
    with guarded(grid, "reduce-scatter", axis, tag, moved):
        work = reduce_scatter_single(out, moved, group=grid.group(axis), async_op=async_op)
    works = [(work, "reduce-scatter", axis)] if async_op else []
    return Posted(grid, tag, works, lambda: out.movedim(0, dim).contiguous(), (moved, out))


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(grid: Grid, axis: int, t: torch.Tensor, tag: str, phase: str, op: str = "sum"):
    """Sum (or `op`, a key of REDUCE_OPS) of the members' `t`, as a new tensor (traceable:
    `passes.ops.library`)."""
    if grid.size(axis) == 1:
        return t.clone(memory_format=torch.contiguous_format)
    return torch.ops.autopar.all_reduce(t, grid.key, axis, tag, phase, op)


def all_reduce_stack(grid: Grid, axis: int | None, parts: list, tag: str, phase: str) -> torch.Tensor:
    """`all_reduce` of torch.stack(parts) over `axis` (None: the stack alone), the stack made inside the
    op: a stack traced by torch.compile into a concatenation whose halves inductor reuses in place
    could be overwritten while still saved for backward (seen on torch 2.13 with the norm statistics)."""
    return torch.ops.autopar.all_reduce_stack(parts, grid.key, -1 if axis is None else axis, tag, phase)


def run_all_reduce_stack(grid: Grid, axis: int, parts: list, tag: str, phase: str) -> torch.Tensor:
    """`all_reduce_stack` now (axis -1 or of one member: the stack alone): the body of its op."""
    t = torch.stack(parts)
    return t if axis < 0 or grid.size(axis) == 1 else run_all_reduce(grid, axis, t, tag, phase)


def run_all_reduce(grid: Grid, axis: int, t: torch.Tensor, tag: str, phase: str, op: str = "sum"):
    """`all_reduce` now, on a group of more than one member: the body of its torch.library op."""
    t = t.clone(memory_format=torch.contiguous_format)
    grid.log.add(tag, phase, all_reduce_bytes(tensor_bytes(t), grid.size(axis)))
    grid.log.launch(tag, phase)
    with guarded(grid, "all-reduce", axis, tag, t):
        dist.all_reduce(t, op=REDUCE_OPS[op], group=grid.group(axis))
    return t


def block(grid: Grid, axis: int, t: torch.Tensor, dim: int, parts: int = 1) -> torch.Tensor:
    """This member's block of `dim` (its torch.chunk block when the group does not divide `dim`); with
    parts=k, its block of each of the k equal parts, side by side."""
    i = grid.index(axis)
    if parts == 1:
        lo, hi = chunk_range(t.shape[dim], grid.size(axis), i)
        return t.narrow(dim, lo, hi - lo)
    m = t.movedim(dim, 0)
    m = m.reshape(parts, grid.size(axis), -1, *m.shape[1:])[:, i].reshape(-1, *m.shape[1:])
    return m.movedim(0, dim)


def _unstride(grid: Grid, axis: int, t: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """Gathered blocks [c][part] (what all-gather of interleaved blocks gives) -> [part][c]."""
    if parts == 1:
        return t
    m = t.movedim(dim, 0)
    m = m.reshape(grid.size(axis), parts, -1, *m.shape[1:]).transpose(0, 1).reshape(m.shape)
    return m.movedim(0, dim).contiguous()


class Gather(torch.autograd.Function):
    """Shard(dim) (or Strided(dim, parts)) -> Replicate: all-gather forward, own block backward.
    `full`: the dim's global size, needed when the group does not divide it (unequal blocks)."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, tag, parts=1, full=None):
        ctx.args = (grid, axis, dim, parts)
        return _unstride(grid, axis, all_gather(grid, axis, x, dim, tag, "fwd", full), dim, parts)

    @staticmethod
    def backward(ctx, g):
        grid, axis, dim, parts = ctx.args
        return block(grid, axis, g, dim, parts).contiguous(), None, None, None, None, None, None


class GatherSum(torch.autograd.Function):
    """Shard(dim) -> Replicate for a consumer whose gradient is this rank's share only (split work
    reads the whole tensor): all-gather forward, reduce-scatter backward. That is the sum over the
    group (the GradSync all-reduce) and this member's block (Gather's backward) as one collective of
    half the bytes: Megatron's sequence-parallel all-gather (`passes.transforms.insert_collectives`
    folds a GradSync into the gather before it)."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, tag, full=None):
        ctx.args = (grid, axis, dim, tag)
        return all_gather(grid, axis, x, dim, tag, "fwd", full)

    @staticmethod
    def backward(ctx, g):
        grid, axis, dim, tag = ctx.args
        return reduce_scatter(grid, axis, g, dim, tag, "bwd"), None, None, None, None, None


class Split(torch.autograd.Function):
    """Replicate -> Shard(dim) (or Strided(dim, parts)): own block forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, tag, parts=1):
        ctx.args = (grid, axis, dim, tag, parts, x.shape[dim])
        return block(grid, axis, x, dim, parts).contiguous()

    @staticmethod
    def backward(ctx, g):
        grid, axis, dim, tag, parts, full = ctx.args
        whole = _unstride(grid, axis, all_gather(grid, axis, g, dim, tag, "bwd", full), dim, parts)
        return whole, None, None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """Partial -> Shard(dim): reduce-scatter forward, all-gather backward (scaled 1/q for avg)."""

    @staticmethod
    def forward(ctx, x, grid, axis, dim, avg, tag):
        ctx.args = (grid, axis, dim, avg, tag, x.shape[dim])
        out = reduce_scatter(grid, axis, x, dim, tag, "fwd")
        return out / grid.size(axis) if avg else out

    @staticmethod
    def backward(ctx, g):
        grid, axis, dim, avg, tag, full = ctx.args
        out = all_gather(grid, axis, g, dim, tag, "bwd", full)
        return (out / grid.size(axis) if avg else out), None, None, None, None, None


class AllReduce(torch.autograd.Function):
    """Partial -> Replicate: all-reduce forward; backward passes the replicated gradient through."""

    @staticmethod
    def forward(ctx, x, grid, axis, avg, tag):
        ctx.args = (grid.size(axis), avg)
        out = all_reduce(grid, axis, x, tag, "fwd")
        return out / grid.size(axis) if avg else out

    @staticmethod
    def backward(ctx, g):
        q, avg = ctx.args
        return (g / q if avg else g), None, None, None, None


class GradSync(torch.autograd.Function):
    """A replicated tensor used by split work: identity forward, all-reduce of its gradient backward.

    Each member's backward yields only its block's share of the gradient; the sum over the group is
    the full gradient that the replicated placement promises.
    """

    @staticmethod
    def forward(ctx, x, grid, axis, tag):
        ctx.args = (grid, axis, tag)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        grid, axis, tag = ctx.args
        return all_reduce(grid, axis, g, tag, "bwd"), None, None, None


class ToPartial(torch.autograd.Function):
    """Replicate -> Partial: member 0 keeps the value (sum) or all keep it (avg); backward identity."""

    @staticmethod
    def forward(ctx, x, grid, axis, avg):
        return x.clone() if avg or grid.index(axis) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None
