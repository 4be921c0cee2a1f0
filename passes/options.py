"""The options of a compile, each declared once and validated once.

Every option is one field of `Options`, declared with `option(...)`: its default, its type (the field's
annotation), the values it takes (a few `choices`, or a `check` with the words `expected` for it), its
unit and one line saying what it decides. The rest is read from that declaration: `Options` validates
by it, `OPTIONS` / `OPTION` list it for readers outside (the `autopar inspect` flags take their choices
and help from it), `markdown_table` renders the README's option table, and tests compare the keywords
of `parallelize`, `plan` and `choose_grid` with it.

`parallelize` and `plan` build one `Options` from their keyword arguments and pass it down to the
passes (`strategy.choose`, `propagate`), so every stage reads the same values with the same defaults
and no stage re-checks them. A bad value raises a `UsageError` (a ValueError) naming the option, the value given,
the values expected and what to pass instead, before anything is captured.

>>> Options().indivisible
'uneven'
>>> Options(lowering="cannon")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
passes.errors.UsageError: lowering='cannon': expected one of ('auto', 'broadcast', 'allgather', 'ring'); ...
>>> OPTION["search_budget"].unit, OPTION["search_budget"].default
('s', 30.0)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from passes.cost.context import FLAVOURS as CP_FLAVOURS
from passes.cost.model import CostModel
from passes.errors import UsageError

__all__ = ["Options", "Option", "OPTIONS", "OPTION", "DEFAULTS", "BUDGET_S", "STRATEGIES", "RECOMPUTE_MODES",
           "INDIVISIBLE", "DATA_PARALLEL", "LOWERINGS", "LOWERING_CHOICES", "markdown_table", "parse_bytes",
           "format_bytes"]

LOWERINGS = ("broadcast", "allgather", "ring")  # how a SUMMA product moves its panels (passes.ops.summa, .ring)
# the lowering option: one of LOWERINGS for every product, or "auto": each product the one the cost model
# prices faster (passes.search.lowering.pick_lowerings)
LOWERING_CHOICES = ("auto",) + LOWERINGS
BUCKET_MB = 25.0  # default cap per replica gradient bucket, MiB (what DistributedDataParallel uses)
BUDGET_S = 30.0  # default search_budget: seconds before the search stops with the best found so far
STRATEGIES = ("2d", "1d", "auto", "3d")
RECOMPUTE_MODES = ("blocks", "selective")  # passes.transforms.recompute.MODES
# a dim the grid does not divide: split in torch.chunk blocks where a rule can, else run unsplit (the
# only choice for "replicate"), or raise
INDIVISIBLE = ("uneven", "replicate", "error")
# grid=(dp, R, C): the replicas' copies of a block (autopar.parallel.sharded); "auto": "shard" where only it fits
# memory_limit (passes.compile)
DATA_PARALLEL = ("replicate", "shard", "auto")

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One option as declared: what `Options` checks, the command line offers and the docs list."""

    name: str
    type: str  # the annotation, as parallelize's signature writes it
    default: object
    help: str  # what the option decides, in one line
    choices: tuple = ()  # every valid value, when they are a few
    check: Callable[[Any], bool] | None = None  # whether a value is valid, when they are many
    expected: str = ""  # the valid values in words, for the error; default: the choices
    unit: str = ""
    keyword: bool = True  # a keyword of parallelize; False: max_batch's (optimizer_states) or autopar's own

    def valid(self, value) -> bool:
        if self.check is not None:
            return self.check(value)
        # by type as well as value: 1 == True and 0 == False, but check_inputs=1 or recompute=0 is a mistake
        return any(isinstance(value, type(c)) and value == c for c in self.choices)

    def error(self, value) -> UsageError:
        expected = self.expected or f"one of {self.choices}"
        fix = "pass one of these, or leave" if self.choices else "leave"
        return UsageError(f"{self.name}={value!r}: expected {expected}; {fix} {self.name} out for the default "
                          f"{self.default!r}")


def option(default: T, help: str, *, choices: tuple = (), check: Callable[[Any], bool] | None = None,
           expected: str = "", unit: str = "", keyword: bool = True) -> T:
    """A field of `Options` with its declaration; the name and type are the field's own."""
    spec = dict(default=default, help=help, choices=choices, check=check, expected=expected, unit=unit,
                keyword=keyword)
    return field(default=default, metadata={"option": spec})


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MIN_MEMORY_LIMIT = 2**20  # the command line reads a plain number below 1 MiB as a unit mistake ('80' for 80 GiB)


def parse_bytes(value) -> float | None:
    """A size in bytes from a number (bytes) or a string with a unit: '8GiB', '500MB', '1.5 TiB',
    '1048576' (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB, any case). None when it is neither.

    >>> parse_bytes("8GiB"), parse_bytes("500 MB"), parse_bytes(2**30)
    (8589934592, 500000000, 1073741824)
    """
    if _number(value):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip().lower().replace(" ", "").replace("_", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        n = float(number)
    except ValueError:
        return None
    if unit not in _UNITS:
        return None
    n *= _UNITS[unit]
    return int(n) if n == int(n) else n


def format_bytes(n: float) -> str:
    """A size for people: '512 B', '3.0 MiB', '8.00 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _memory_limit_ok(v) -> bool:
    n = parse_bytes(v)
    return v is None or (n is not None and n > 0)


@dataclass(frozen=True)
class Options:
    """How a model is compiled and run; the defaults are `parallelize`'s. Each field's declaration says
    in a line what it decides, `parallelize`'s docstring at length. `optimizer_states` (per-parameter
    tensors of the optimizer; AdamW: 2) only enters strategy='auto''s memory estimate; `check_inputs`,
    `timeout` and `compile` only the run time. `forward_only` (set by `pmodel.generate` for a phase's
    own plan, not a `parallelize` keyword): the search prices a forward with no backward, no gradient
    reductions, nothing saved for backward and no gradient or optimizer state, which is what inference
    runs."""

    lowering: str = option(
        "auto", "how a SUMMA product moves its panels: each product the way the cost model prices faster, "
        "stepwise broadcasts (the paper's; one block in flight), all-gathered panels and one matmul (fewer "
        "calls, q x the temporary panel), or the broadcasts' pieces point to point in Cannon's rotated order "
        "(no collectives; only when asked)", choices=LOWERING_CHOICES)
    overlap: bool | str = option(
        "auto", "whether communication runs behind the matmuls: each SUMMA product's next panel posted before "
        "the current panel's matmul (broadcast and ring lowerings; the all-gather lowering's two gathers posted "
        "together) and each weight gradient's reduction behind the input gradient's product, or every transfer "
        "waited for before the compute that follows; 'auto': on where the cost model says a matmul hides a "
        "transfer", choices=("auto", True, False),
        expected="'auto' (on where the cost model's `hidden` share is above 0), True (overlap) or False (every "
                 "collective waited for in line)")
    indivisible: str = option(
        "uneven", "a dim the grid does not divide: split in torch.chunk blocks where a rule can, run its matmuls "
        "unsplit, or raise a ShardingError", choices=INDIVISIBLE)
    fused: str = option(
        "regroup", "how a fused projection's weight (q, k, v or gate, up in one matmul) is stored: plain blocks "
        "regrouped each step, or interleaved", choices=("regroup", "interleave"))
    on_unsupported: str = option(
        "replicate", "an op with no split form: run it whole on every rank with a FallbackWarning, or raise",
        choices=("replicate", "error"))
    strategy: str = option(
        "2d", "how each weight matmul is split: SUMMA on the grid, Megatron 1D with sequence parallelism over its "
        "columns, the fastest estimate per matmul group (with grid=p, a device count, also the grid or cube), or "
        "3D on a q x q x q cube (grid=(q, q, q))",
        choices=STRATEGIES,
        expected="'2d' (SUMMA), '1d' (Megatron column/row splits over the grid's columns), 'auto' (chosen per "
                 "matmul from estimated step time) or '3d' (grid=(q, q, q))")
    cost_model: object = option(
        None, "for strategy='auto', lowering='auto' and overlap='auto': what collectives and matmuls cost on this "
        "machine, and how much of a transfer a matmul beside it hides",
        check=lambda v: v is None or isinstance(v, (CostModel, dict, str, os.PathLike)),
        expected="None (published GPU-cluster figures), the path or dict of JSON that `autopar calibrate` wrote, "
                 "or a passes.cost.model.CostModel")
    memory_limit: float | str | None = option(
        None, "for strategy='auto': the estimated memory a rank may hold: parameters, gradients, optimizer "
        "states and activations", check=_memory_limit_ok,
        expected="a positive number of bytes per rank (e.g. 40 * 2**30), a string with a unit ('40GiB', "
                 "'500MB'), or None for no limit",
        unit="bytes per rank")
    search_budget: float | None = option(
        BUDGET_S, "for strategy='auto': how long the search may take before it keeps the best plan found so far",
        check=lambda v: v is None or (_number(v) and v >= 0),
        expected=f"seconds >= 0 (e.g. {BUDGET_S:g}) or None for no time limit", unit="s")
    check_inputs: bool = option(
        True, "check on every call that the ranks of a grid got the same inputs (one all-reduce of 4 int64)",
        choices=(True, False),
        expected="True (compare every call's inputs across the ranks of a grid) or False")
    checks: str = option(
        "auto", "when a run-time check's verdict (inputs agree, ids and targets in range) is read: 'now' (a "
        "device-to-host sync each), 'late' (at the next call, no sync), 'auto' (now on the CPU, late elsewhere)",
        choices=("auto", "now", "late"))
    timeout: float | None = option(
        None, "how long every collective of a step waits for its peers before raising a CollectiveError",
        check=lambda v: v is None or (_number(v) and v > 0),
        expected="a positive number of seconds, or None for the process group's own timeout", unit="s")
    optimizer_states: int = option(
        2, "tensors the optimizer keeps per parameter, in strategy='auto''s memory estimate",
        check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        expected="the number of tensors the optimizer keeps per parameter (AdamW: 2, SGD with momentum: 1, "
                 "plain SGD: 0)", keyword=False)
    compile: bool = option(
        False, "run each rank's program under torch.compile (inductor)", choices=(True, False),
        expected="True (run each rank's program under torch.compile) or False (eager)")
    recompute: str | bool | None = option(
        None, "activation recomputation: none unless a memory_limit asks, never, repeated blocks, or the local "
        "ops between matmuls", choices=(None, False, *RECOMPUTE_MODES),
        expected="None (keep every activation for backward; strategy='auto' may recompute blocks to fit "
                 "memory_limit), False (never recompute), 'blocks' (keep each repeated block's inputs, run the "
                 "block again in backward) or 'selective' (keep matmul and communication outputs, recompute "
                 "the local ops between them)")
    recompute_blocks: int | None = option(
        None, "with recompute='blocks': the first k repeated blocks of the model (of each pipeline stage) "
        "recomputed, the rest keeping their activations", check=lambda v: v is None or (
            isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        expected="None (every repeated block) or a number of blocks >= 1, with recompute='blocks'")
    forward_only: bool = option(
        False, "price a forward alone, with no backward (a generation phase's plan)", choices=(True, False),
        expected="True (price a forward alone, as inference runs) or False (a training step)", keyword=False)
    grad_bucket_mb: float = option(
        BUCKET_MB, "with grid=(dp, R, C): the most parameter gradients one all-reduce over the replicas carries",
        check=lambda v: _number(v) and v >= 0,
        expected="MiB >= 0 of parameter gradients per data-parallel all-reduce (0: one all-reduce per "
                 "parameter block)", unit="MiB")
    moe_dispatch: str = option(
        "auto", "how a mixture of experts' routed tokens reach the rows holding their experts ('auto': "
        "all-to-all on a grid of more than one row, else gather)", choices=("auto", "all_to_all", "gather"))
    data_parallel: str = option(
        "replicate", "with grid=(dp, R, C): each replica holds its grid block's parameters, gradients and "
        "optimizer state whole (gradients all-reduced), or 1/dp of them (FSDP2: parameters all-gathered for "
        "the step, gradients reduce-scattered), or the faster of the two that fits memory_limit",
        choices=DATA_PARALLEL,
        expected="'replicate' (every replica holds its grid block whole), 'shard' (FSDP2's fully_shard over "
                 "the replicas: 1/dp of the block each) or 'auto' ('shard' only where 'replicate' does not fit "
                 "memory_limit)")
    reshard_after_forward: bool = option(
        True, "with data_parallel='shard': release each repeated block's gathered parameters after its forward "
        "and gather them again for its backward (FSDP2's default), or keep them from forward to backward",
        choices=(True, False),
        expected="True (FSDP2's default: each block's parameters gathered twice a step, held one block at a "
                 "time) or False (gathered once, held from its forward to its backward)")
    fsdp_prefetch: int | None = option(
        None, "with data_parallel='shard': how many blocks ahead each block's gather is started (None: "
        "FSDP2's own, the next block in backward)",
        check=lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        expected="None (FSDP2's implicit prefetching) or a number of blocks >= 1 whose gathers each block "
                 "starts before it runs, in forward and in backward")
    context_parallel: int = option(
        1, "ranks each sequence is split over (each holds 1/cp of every activation's tokens, zig-zag; attention "
        "exchanges heads with them, passes keys and values around them, or gathers those: context_attention)",
        check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        expected="a number of ranks >= 1 (1: no context parallelism; cp > 1 needs a world of (dp *) cp * R * C "
                 "ranks and a sequence length divisible by 2 * cp)")
    context_attention: str = option(
        "auto", "with context_parallel: how each attention sees the other cp ranks' tokens: 'alltoall' (heads "
        "exchanged, DeepSpeed-Ulysses), 'ring' (keys and values passed around the cp ranks beside the block "
        "products), 'allgather' (keys and values gathered whole), or 'auto' (all-to-all where this rank's query "
        "and KV heads divide by cp, else the ring)",
        choices=("auto",) + CP_FLAVOURS,
        expected="'auto', 'alltoall' (this rank's query and KV heads divisible by cp), 'ring' (no attention "
                 "dropout) or 'allgather'")
    replicas: int = option(
        1, "data-parallel replicas of the grid (grid=(dp, R, C)), which the memory estimate divides sharded "
        "state by", check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        expected="a positive number of replicas", keyword=False)

    def __post_init__(self) -> None:
        for o in OPTIONS:
            value = getattr(self, o.name)
            if not o.valid(value):
                raise o.error(value)
        if self.recompute_blocks is not None and self.recompute != "blocks":
            raise UsageError(f"recompute_blocks={self.recompute_blocks!r} with recompute={self.recompute!r}: it says "
                             f"how many blocks recompute='blocks' recomputes; pass recompute='blocks' too")
        if isinstance(self.memory_limit, str):  # '8GiB': kept as bytes, what every stage reads
            object.__setattr__(self, "memory_limit", parse_bytes(self.memory_limit))

    @property
    def memory_limit_bytes(self) -> float | None:
        """memory_limit in bytes, as every stage reads it (a string with a unit was converted when the
        Options were built)."""
        limit = self.memory_limit
        assert not isinstance(limit, str), "converted in __post_init__"
        return limit

    @property
    def fixed_lowering(self) -> str | None:
        """The lowering every SUMMA product runs, or None where each takes the one the cost model prices
        faster (lowering='auto')."""
        return None if self.lowering == "auto" else self.lowering

    def overlaps(self, cm: CostModel) -> bool:
        """Whether communication runs behind compute (`overlap`; 'auto': where `cm` hides any of a
        transfer behind a matmul)."""
        return self.overlap if isinstance(self.overlap, bool) else cm.hidden > 0

    def items(self) -> list:
        """(name, value) of every option, in declaration order (what ranks compare before compiling)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


OPTIONS = tuple(Option(name=f.name, type=str(f.type), **f.metadata["option"]) for f in fields(Options))
OPTION = {o.name: o for o in OPTIONS}
DEFAULTS = Options()  # the keyword defaults of parallelize, plan and choose_grid


def markdown_table() -> str:
    """The keyword options of `parallelize` as a Markdown table: option, default, allowed values,
    unit and meaning (the README's table; `python -m tests.test_options_table` writes it there)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| option | default | allowed | unit | meaning |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        if not o.keyword:
            continue
        allowed = ", ".join(f"`{c!r}`" for c in o.choices) if o.choices else o.expected
        rows.append(f"| `{o.name}` | `{o.default!r}` | {cell(allowed)} | {o.unit} | {cell(o.help)} |")
    return "\n".join(rows) + "\n"
