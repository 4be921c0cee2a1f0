"""Index bounds: an id or a target outside its table raises, as it does on one process.

A vocab-split lookup reads an id outside this rank's block of the table as a zero row (another rank
holds that row); an id outside the whole table lies outside every block, so without a check the
blocks sum to a zero row and the model runs on where one process raises IndexError. The ids reach
every rank whole (replicated), so each rank checks them itself and every rank raises the same error,
with no communication. Cross-entropy targets arrive in row blocks: each rank counts the targets of
its block outside [0, V) (ignore_index aside), the count travels in the loss's existing (loss,
tokens) all-reduce over the mesh rows, and every rank reads it; only when it is not zero does one
more all-reduce bring every rank the smallest and largest offending values, for the message. Each
verdict is read when the `checks` option says (`passes.ops.verdicts`): at once on the CPU, at the next
call on an accelerator (no host sync in the step; the message then names this rank's offending values).

>>> import torch
>>> check_ids(torch.tensor([[0, 5]]), 6, "the table 'wte' (6 rows)")
>>> try:
...     check_ids(torch.tensor([[0, 6]]), 6, "the table 'wte' (6 rows)")
... except IndexError as e:
...     print(str(e)[:51])
id 6 is outside [0, 6) at the table 'wte' (6 rows);
"""

from __future__ import annotations

import torch

from passes.errors import IndexRangeError
from passes.mesh import Grid
from passes.ops import comm
from passes.ops.verdicts import VERDICTS

_HINT = {
    "id": "An id must lie in [0, num_embeddings) of the table it looks up: check the tokenizer's vocabulary "
          "against the model's vocab_size, or the sequence length against the position table "
          "(max_position_embeddings)",
    "target": "A target must lie in [0, vocab size) or equal ignore_index: check the labels against the "
              "model's vocab_size, and pad them with ignore_index (-100 in transformers)",
}


def _error(kind: str, lo: int, hi: int, size: int, where: str, ignore: int | None) -> IndexRangeError:
    bad = lo if lo < 0 else hi
    others = f" (values seen from {lo} to {hi})" if lo != hi and lo < 0 and hi >= size else ""
    ign = f", or ignore_index {ignore}" if ignore is not None else ""
    return IndexRangeError(
        f"{kind} {bad} is outside [0, {size}){ign} at {where}{others}; one process raises IndexError "
        f"here, and autopar does on every rank. {_HINT[kind]}")


def _raise(kind: str, lo: int, hi: int, size: int, where: str, ignore: int | None) -> None:
    raise _error(kind, lo, hi, size, where, ignore)


def check_ids(ids: torch.Tensor, size: int, where: str) -> None:
    """Raise IndexRangeError naming the value and range unless every id lies in [0, size) (at once, or
    at the next call: `passes.ops.verdicts`)."""
    if ids.numel() == 0:
        return
    ends = torch.stack(torch.aminmax(ids.reshape(-1)))
    VERDICTS.check(ends, lambda e: 0 <= e[0] and e[1] < size, lambda e: _error("id", e[0], e[1], size, where, None))


def out_of_range(target: torch.Tensor, size: int, ignore: int) -> torch.Tensor:
    """How many targets lie outside [0, size) and are not `ignore`: a 0-d count of target's dtype."""
    return ((target != ignore) & ((target < 0) | (target >= size))).sum()


def check_targets(grid: Grid, axis: int, target: torch.Tensor, size: int, ignore: int, count: torch.Tensor,
                  tag: str, where: str) -> None:
    """Raise IndexRangeError on every rank when `count` (the out-of-range targets summed over mesh
    `axis`, -1: this rank's alone) is not zero; the values for the message are gathered over `axis`
    only then (read at once), or this rank's own (read at the next call: `passes.ops.verdicts`)."""
    if not VERDICTS.now(count.device):
        return _check_targets_late(target, size, ignore, count, where)
    if int(count) == 0:
        return
    bad = target[(target != ignore) & ((target < 0) | (target >= size))].double()
    ends = torch.stack([-bad.min(), bad.max()]) if bad.numel() else torch.full((2,), -torch.inf, dtype=torch.double)
    if axis >= 0 and grid.size(axis) > 1:
        ends = comm.run_all_reduce(grid, axis, ends.to(target.device), tag, "fwd", op="max")
    _raise("target", int(-ends[0]), int(ends[1]), size, where, ignore)


def _check_targets_late(target: torch.Tensor, size: int, ignore: int, count: torch.Tensor, where: str) -> None:
    """check_targets with its verdict read at the next call: the count and this rank's smallest and largest
    offending targets, computed on the device without a host read (a boolean index would be one)."""
    bad = (target != ignore) & ((target < 0) | (target >= size))
    t = target.to(torch.int64)
    big = torch.iinfo(torch.int64).max
    lo = torch.where(bad, t, big).min() if t.numel() else torch.full((), big, device=t.device)
    hi = torch.where(bad, t, -big).max() if t.numel() else torch.full((), -big, device=t.device)
    seen = torch.stack([count.to(torch.int64), lo, hi])

    def error(got: list) -> IndexRangeError:
        if got[1] <= got[2]:  # this rank's rows hold offending targets
            return _error("target", got[1], got[2], size, where, ignore)
        return IndexRangeError(f"{got[0]} target(s) outside [0, {size}) (ignore_index {ignore} aside) at {where}, in "
                               f"rows other ranks hold; one process raises IndexError here. {_HINT['target']}")

    VERDICTS.check(seen, lambda got: got[0] == 0, error)
