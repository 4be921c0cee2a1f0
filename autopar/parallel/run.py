"""How a ParallelModule runs one compiled program on this rank's blocks: eagerly, or with
`compile=True` under torch.compile, compiled on the program's first call and reused; with data-parallel
replicas, eagerly with the `Arrive` calls that launch each gradient bucket's all-reduce in backward."""

from __future__ import annotations

import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from autopar.errors import CompileWarning
from autopar.program.build import Compiled
from passes.compat import dynamo_counts, real_tensors
from passes.mesh import warn
from passes.ops import comm
from passes.ops.verdicts import mark_host
from passes.ops.grad_buckets import StepBuckets, with_arrivals
from passes.ops.library import INDUCTOR_OPTIONS

__all__ = ["CompileStats", "Runner"]


def _say(text: str) -> None:
    """A progress line on rank 0's stderr (the other ranks compile the same program at the same time)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


class CompileStats(NamedTuple):
    """What dynamo made of one program under parallelize(..., compile=True): the graphs it compiled
    and the graph breaks between them (0 when every kernel and collective traced)."""
    graphs: int
    breaks: int


class Runner:
    """The callable that runs each program of one ParallelModule, by the program's signature."""

    def __init__(self, compile: bool):
        self.compile = compile
        self.stats: dict = {}  # signature -> CompileStats of its first compiled call (compile=True)
        self._callables: dict = {}  # (signature, compiled?) -> the callable running that program
        self._arrival_programs: dict = {}  # signature -> the eager program with its buckets' Arrive calls
        # observer(gm, args) -> outputs runs each eager call instead of gm(*args) while set: how
        # `autopar.debug.verify` reads every node's value (ParallelModule.observing)
        self.observer = None
        self.observe_compiled = False  # the observer runs compiled programs' calls too (eagerly)

    def __call__(self, comp: Compiled, locals_: list, step: StepBuckets | None = None, compile: bool = False):
        """comp's graph on `locals_` (this rank's blocks and inputs, in `comp.captured.sources` order),
        compiled when the module was built with compile=True or when `compile` (the call came through
        the user's torch.compile(pmodel)). A program torch.compile cannot compile runs eagerly from
        then on, with one CompileWarning shown by rank 0 (`passes.mesh.warn`): every rank compiles the
        same program, so all of them fail and fall back alike. `step`: the replicas' gradient buckets;
        an eager program then runs with their `Arrive` calls."""
        compile = compile or self.compile
        if self.observer is not None and (not compile or self.observe_compiled):
            if step is not None:
                return self.observer(self._with_arrivals(comp, step), (*locals_, step))
            return self.observer(comp.gm, tuple(locals_))
        key = (comp.signature, compile)
        runner = self._callables.get(key)
        if step is not None and runner is comp.gm:
            return self._with_arrivals(comp, step)(*locals_, step)
        if runner is not None:
            return runner(*locals_)
        if not compile:
            self._callables[key] = comp.gm
            return self(comp, locals_, step)
        compiled = torch.compile(comp.gm, options=INDUCTOR_OPTIONS)  # order kept: compat.keep_effect_order_in_inductor
        before = dynamo_counts()
        started = time.perf_counter()
        _say(f"autopar: compiling a program with torch.compile (the first call of this input signature; "
             f"{len(comp.gm.graph.nodes)} graph nodes; a minute or more on a busy machine) ...")
        try:
            outs = compiled(*locals_)
        except comm.CollectiveError:
            raise
        except Exception as e:  # a dynamo / inductor failure: this program runs eagerly
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            warn(f"autopar: torch.compile could not compile this program ({type(e).__name__}: {first}); it runs "
                 f"eagerly", CompileWarning, stacklevel=4)
            self._callables[key] = comp.gm
            return comp.gm(*locals_)
        self._callables[key] = compiled
        after = dynamo_counts()
        self.stats[comp.signature] = CompileStats(after[0] - before[0], after[1] - before[1])
        _say(f"autopar: compiled in {time.perf_counter() - started:.1f} s ({after[0] - before[0]} graph(s), "
             f"{after[1] - before[1]} graph break(s)); later calls of this signature reuse it")
        return outs

    def with_rank_rng(self, comp: Compiled, locals_: list, rank: int, step: StepBuckets | None = None,
                      compile: bool = False):
        """As a call, with dropout masks independent per block: one number drawn from the default
        generator (equal on ranks seeded alike, so the user's RNG advances the same everywhere) seeds
        this rank's stream."""
        with real_tensors():  # a draw on the host's generator, real even inside a dry run's fake tensors
            seed = int(mark_host(torch.randint(0, 2**62, (1,))).item())  # the CPU generator's: no device sync
        devices = [comp.captured.device] if comp.captured.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((seed + 1_000_003 * (rank + 1)) % 2**63)
            return self(comp, locals_, step, compile)

    def _with_arrivals(self, comp: Compiled, step: StepBuckets):
        gm = self._arrival_programs.get(comp.signature)
        if gm is None:
            gm = self._arrival_programs[comp.signature] = with_arrivals(comp.gm, step.plan)
        return gm
