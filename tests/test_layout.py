"""Unit tests for passes/layout.py and the reshape dim-grouping helpers of passes/rules/views.py.

Pure single-process checks; no torch.distributed.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from passes.layout import REPLICATED, Layout, ShardingError, local_shape
from passes.rules.views import reshape_groups, reshape_mapping

S, R = Shard, Replicate


# ---------------------------------------------------------------------------------------- Layout


@pytest.mark.parametrize(
    "placements, text",
    [
        ((S(0), S(2)), "S(0)S(2)"),
        ((R(), S(0)), "RS(0)"),
        ((Partial("sum"), R()), "P(sum)R"),
        ((R(), Partial("avg")), "RP(avg)"),
        ((R(), R()), "RR"),
        ((S(-1), R()), "S(-1)R"),
    ],
)
def test_layout_repr(placements, text):
    """The compact repr is what explain tables and error messages print; catches a changed or
    swapped axis order (axis 0 must print first)."""
    assert repr(Layout(placements)) == text


def test_layout_equality_and_hash():
    """Layouts are compared (have != need) and used as dict keys by insert_collectives; catches a
    Layout that stops being a frozen value type."""
    a = Layout((S(0), S(2)))
    b = Layout((Shard(0), Shard(2)))
    assert a == b and hash(a) == hash(b)
    assert a != Layout((S(2), S(0)))
    assert len({a, b, REPLICATED}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.placements = (R(), R())


def test_layout_getitem_and_flags():
    """Axis indexing, is_replicated and has_partial drive every rule; catches axis mix-ups."""
    lay = Layout((S(1), Partial("sum")))
    assert lay[0] == S(1) and lay[1] == Partial("sum")
    assert lay.has_partial and not lay.is_replicated
    assert REPLICATED.is_replicated and not REPLICATED.has_partial
    assert not Layout((R(), S(0))).is_replicated


def test_layout_same_dim_twice_asserts():
    """Two mesh axes can never split the same tensor dim; catches a rule that builds such a layout
    silently (it would make every rank's block ambiguous)."""
    with pytest.raises(AssertionError, match="two mesh axes shard the same dim"):
        Layout((S(1), S(1)))
    Layout((S(1), S(0)))  # different dims are fine
    Layout((Partial("sum"), Partial("sum")))  # partial on both axes is fine


def test_layout_with_axis():
    """with_axis replaces exactly one axis and returns a new Layout; catches in-place mutation or a
    wrong axis being replaced."""
    lay = Layout((S(0), S(2)))
    new = lay.with_axis(1, R())
    assert new == Layout((S(0), R())) and lay == Layout((S(0), S(2)))
    assert lay.with_axis(0, Partial("avg")) == Layout((Partial("avg"), S(2)))
    with pytest.raises(AssertionError):
        lay.with_axis(1, S(0))  # would shard dim 0 twice


def test_layout_shard_axis():
    """shard_axis answers 'which mesh axis splits this dim'; catches off-by-axis results."""
    lay = Layout((S(0), S(2)))
    assert lay.shard_axis(0) == 0
    assert lay.shard_axis(2) == 1
    assert lay.shard_axis(1) is None
    assert Layout((Partial("sum"), S(1))).shard_axis(1) == 1
    assert REPLICATED.shard_axis(0) is None


def test_layout_normalized():
    """Negative shard dims become positive (rules compare dims numerically); catches a
    normalization that touches Replicate/Partial or uses the wrong ndim."""
    assert Layout((S(-1), S(0))).normalized(3) == Layout((S(2), S(0)))
    assert Layout((R(), S(-2))).normalized(4) == Layout((R(), S(2)))
    assert Layout((Partial("sum"), S(-1))).normalized(2) == Layout((Partial("sum"), S(1)))
    assert REPLICATED.normalized(3) == REPLICATED


# ---------------------------------------------------------------------------------- local_shape


@pytest.mark.parametrize(
    "shape, placements, q, expected",
    [
        ((8, 16, 32), (S(0), S(2)), 2, (4, 16, 16)),
        ((8, 16, 32), (S(2), S(0)), 2, (4, 16, 16)),
        ((6, 9, 12), (S(1), S(2)), 3, (6, 3, 4)),
        ((6, 9, 12), (R(), S(0)), 3, (2, 9, 12)),
        ((6, 9, 12), (Partial("sum"), R()), 3, (6, 9, 12)),
        ((6, 9, 12), (R(), R()), 3, (6, 9, 12)),
        ((4, 8), (S(-1), R()), 2, (4, 4)),  # negative dims index from the right
        ((12,), (R(), S(0)), 4, (3,)),
    ],
)
def test_local_shape(shape, placements, q, expected):
    """The block shape every rank holds; localize bakes it into view/reshape/expand, so a wrong
    value here is a runtime shape error (or a silent wrong reshape) on every rank."""
    assert local_shape(shape, Layout(placements), q) == expected


def test_local_shape_does_not_mutate_input():
    """local_shape must not edit the caller's list (meta shapes are shared)."""
    shape = [8, 4]
    local_shape(shape, Layout((S(0), S(1))), 2)
    assert shape == [8, 4]


def test_local_shape_not_divisible_message():
    """The error names what could not be split, the dim, its size and q; catches a bare
    ZeroDivision/assert or a message that hides the offending size."""
    with pytest.raises(ShardingError) as e:
        local_shape((4, 6), Layout((S(0), S(1))), 4, what="weight fc.weight")
    msg = str(e.value)
    assert "weight fc.weight" in msg
    assert "size 6" in msg
    assert "divisible by 4" in msg and "mesh axis 1" in msg
    assert "(4, 6)" in msg
    assert "S(0)S(1)" in msg
    assert isinstance(e.value, ValueError)  # ShardingError is a ValueError


def test_local_shape_not_divisible_other_axis():
    """Divisibility is checked for the dim split over mesh axis 0 too, not only axis 1."""
    with pytest.raises(ShardingError, match="size 5"):
        local_shape((5, 6), Layout((S(0), S(1))), 2)


# ------------------------------------------------------------------------ reshape groups/mapping


@pytest.mark.parametrize(
    "src, dst, groups, mapping",
    [
        # split heads: hidden -> (heads, head_dim); heads is the outermost, so an hidden split survives
        ((4, 8, 32), (4, 8, 4, 8), [([0], [0]), ([1], [1]), ([2], [2, 3])], {0: 0, 1: 1, 2: 2}),
        # merge heads back
        ((4, 8, 4, 8), (4, 8, 32), [([0], [0]), ([1], [1]), ([2, 3], [2])], {0: 0, 1: 1, 2: 2}),
        # flatten batch and sequence: only the batch (outermost) split survives
        ((4, 8, 32), (32, 32), [([0, 1], [0]), ([2], [1])], {0: 0, 2: 1}),
        # and back
        ((32, 32), (4, 8, 32), [([0], [0, 1]), ([1], [2])], {0: 0, 1: 2}),
        # no common boundary: one group, outermost maps to outermost
        ((4, 6), (6, 4), [([0, 1], [0, 1])], {0: 0}),
        # size-1 dims
        ((4, 1, 8), (4, 8), [([0, 1], [0]), ([2], [1])], {0: 0, 2: 1}),
        ((4, 8), (4, 1, 8), [([0], [0, 1]), ([1], [2])], {0: 0, 1: 2}),
        ((1, 4), (4,), [([0, 1], [0])], {1: 0}),
        ((4,), (4, 1), [([0], [0, 1])], {0: 0}),
        ((1, 4), (4, 1), [([0, 1], [0, 1])], {1: 0}),
        ((2, 1, 3), (2, 3, 1), [([0, 1], [0]), ([2], [1, 2])], {0: 0, 2: 1}),  # a trailing 1 joins the group before
    ],
)
def test_reshape_groups_and_mapping(src, dst, groups, mapping):
    """The view/reshape rule keeps a split only on the outermost non-1 dim of each group of merged or
    split dims; a wrong grouping keeps a split that is no longer a contiguous block (silently wrong
    values after the reshape) or crashes."""
    assert reshape_groups(src, dst) == groups
    assert reshape_mapping(src, dst) == mapping
    # the groups cover every dim exactly once, in order, with equal products
    assert [d for gi, _ in groups for d in gi] == list(range(len(src)))
    assert [d for _, gj in groups for d in gj] == list(range(len(dst)))


@pytest.mark.parametrize(
    "src, dst",
    [((), (1,)), ((1,), ()), ((), (1, 1)), ((1, 1), ())],
)
def test_reshape_groups_scalar(src, dst):
    """A 0-d tensor viewed as [1] (e.g. `loss.reshape(1)`, `x.sum().unsqueeze(0)`) or a [1] squeezed
    to 0-d: catches the greedy grouping indexing past the end of an empty shape (IndexError, which
    propagate does not turn into a fallback, so the whole compile crashes)."""
    groups = reshape_groups(src, dst)
    assert [d for gi, _ in groups for d in gi] == list(range(len(src)))
    assert [d for _, gj in groups for d in gj] == list(range(len(dst)))
    assert reshape_mapping(src, dst) == {}
