"""Index bounds: an id or a target outside its table raises, as it does on one process.

A vocab-split lookup reads an id outside this rank's block of the table as a zero row (another rank
holds that row); an id outside the whole table lies outside every block, so without a check the
blocks sum to a zero row and the model runs on where one process raises IndexError. The ids reach
every rank whole (replicated), so each rank checks them itself and every rank raises the same error,
with no communication. Cross-entropy targets arrive in row blocks: each rank counts the targets of
its block outside [0, V) (ignore_index aside), the count travels in the loss's existing (loss,
tokens) all-reduce over the mesh rows, and every rank reads it; only when it is not zero does one
more all-reduce bring every rank the smallest and largest offending values, for the message.

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

_HINT = {
    "id": "An id must lie in [0, num_embeddings) of the table it looks up: check the tokenizer's vocabulary "
          "against the model's vocab_size, or the sequence length against the position table "
          "(max_position_embeddings)",
    "target": "A target must lie in [0, vocab size) or equal ignore_index: check the labels against the "
              "model's vocab_size, and pad them with ignore_index (-100 in transformers)",
}


def _raise(kind: str, lo: int, hi: int, size: int, where: str, ignore: int | None) -> None:
    bad = lo if lo < 0 else hi
    others = f" (values seen from {lo} to {hi})" if lo != hi and lo < 0 and hi >= size else ""
    ign = f", or ignore_index {ignore}" if ignore is not None else ""
    raise IndexRangeError(
        f"{kind} {bad} is outside [0, {size}){ign} at {where}{others}; one process raises IndexError "
        f"here, and autopar does on every rank. {_HINT[kind]}")


def check_ids(ids: torch.Tensor, size: int, where: str) -> None:
    """Raise IndexRangeError naming the value and range unless every id lies in [0, size)."""
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= size:
        _raise("id", lo, hi, size, where, None)


def out_of_range(target: torch.Tensor, size: int, ignore: int) -> torch.Tensor:
    """How many targets lie outside [0, size) and are not `ignore`: a 0-d count of target's dtype."""
    return ((target != ignore) & ((target < 0) | (target >= size))).sum()


def check_targets(grid: Grid, axis: int, target: torch.Tensor, size: int, ignore: int, count: torch.Tensor,
                  tag: str, where: str) -> None:
    """Raise IndexRangeError on every rank when `count` (the out-of-range targets summed over mesh
    `axis`, -1: this rank's alone) is not zero; the values for the message are gathered over `axis`
    only then."""
    if int(count) == 0:
        return
    bad = target[(target != ignore) & ((target < 0) | (target >= size))].double()
    ends = torch.stack([-bad.min(), bad.max()]) if bad.numel() else torch.full((2,), -torch.inf, dtype=torch.double)
    if axis >= 0 and grid.size(axis) > 1:
        ends = comm.run_all_reduce(grid, axis, ends.to(target.device), tag, "fwd", op="max")
    _raise("target", int(-ends[0]), int(ends[1]), size, where, ignore)
