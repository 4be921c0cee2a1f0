"""`autopar.verify`: the parallel program against the unmodified model, on the same inputs, forward,
backward and a few optimizer steps, and on a mismatch the first graph node that differs.

Every rank runs the parallel model and, on its own, the unmodified model (a copy) on the same whole
inputs, so the comparison needs no traffic beyond gathering each parallel gradient and parameter
whole (`DTensor.full_tensor`); the reference costs one whole model per rank. With data-parallel replicas
every replica trains on the same inputs, whose averaged gradient is the one process's.

Tolerances follow the dtype (`TOLERANCES`): a value passes where |got - want| <= atol + rtol |want|
element-wise, with atol a fraction of the largest magnitude in its group (every output, every
gradient, every parameter; a node: its own largest). Steps past the first compare losses and, after
the last, every parameter.

The node-level search (`autopar.debug.nodes`) runs on the first step of the eager programs of a grid
or of each pipeline stage; under compile=True the compiled step is what is compared, and on a mismatch
the same step runs again eagerly through the recorder (its gradients put back) to find the node.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.debug.nodes import Recorder, excess, first_divergence, magnitude, parameter_path, reference
from autopar.errors import UsageError
from passes.compat import pytree
from passes.nodes import module_path

__all__ = ["TOLERANCES", "Finding", "VerifyReport", "available_bytes", "verify"]

# dtype -> (rtol, atol as a fraction of the group's largest magnitude); fp32 as autopar's own parity tests
TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 1e-2),
              torch.float16: (4e-3, 1e-3)}


@dataclass
class Finding:
    """One compared tensor: category ('loss', 'output', 'gradient', 'parameter'), name, the rank that
    compared it, its error relative to its group's largest magnitude, and whether it passed."""
    category: str
    name: str
    rank: int
    error: float
    excess: float

    @property
    def ok(self) -> bool:
        return self.excess <= 1


@dataclass
class VerifyReport:
    """What `verify` found, the same on every rank. `ok`: every loss, output, gradient and parameter
    within tolerance. `divergence`: the first node that differs (None on a clean run, or where no
    node could be compared). `losses`: (parallel, reference) per step."""
    ok: bool
    findings: list
    losses: list
    divergence: object = None
    nodes: tuple = (0, 0)  # (compared, not comparable: partial sums, cube layouts, integer values) on rank 0
    tolerance: tuple = (0.0, 0.0)
    notes: list = field(default_factory=list)

    def worst(self) -> dict:
        """category -> the Finding with the largest relative error."""
        out: dict = {}
        for f in self.findings:
            if f.category not in out or f.error > out[f.category].error:
                out[f.category] = f
        return out

    @property
    def mismatches(self) -> list:
        return [f for f in self.findings if not f.ok]

    def __str__(self) -> str:
        rtol, frac = self.tolerance
        head = "autopar verify: " + ("every value matches" if self.ok else f"{len(self.mismatches)} mismatch(es)")
        lines = [f"{head} (rtol {rtol:g}, atol {frac:g} x each group's largest magnitude)"]
        for step, (got, want) in enumerate(self.losses):
            lines.append(f"  loss step {step}: parallel {got:.7g}, reference {want:.7g}")
        for cat, f in self.worst().items():
            lines.append(f"  largest {cat} error: {f.error:.3g} ({f.name}, rank {f.rank})")
        for f in self.mismatches[:10]:
            what = f.name if f.name.startswith(f.category) else f"{f.category} {f.name}"
            lines.append(f"  MISMATCH {what} on rank {f.rank}: error {f.error:.3g}, {f.excess:.3g}x the tolerance")
        if len(self.mismatches) > 10:
            lines.append(f"  ... and {len(self.mismatches) - 10} more")
        compared, skipped = self.nodes
        if compared or skipped:
            lines.append(f"  nodes compared on rank 0: {compared} ({skipped} not: partial sums, 3D cube layouts, "
                         f"no counterpart in the model's graph)")
        if self.divergence is not None:
            lines.append(str(self.divergence))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def default_loss(out) -> torch.Tensor:
    """The loss the model computes itself: a transformers output's `.loss`, or the first 0-dim
    floating-point tensor among its outputs."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.is_floating_point():
            return leaf
    raise UsageError("verify: the model's output holds no loss (no .loss and no 0-dim floating-point tensor) for "
                     "these inputs; pass loss=fn, where fn(output) returns a scalar (e.g. lambda out: "
                     "F.cross_entropy(out.flatten(0, 1), labels.flatten())), or give the model its labels")


def _leaves(out) -> dict:
    """An output's tensors by their place in it ('output[1]', "output['logits']"), each whole."""
    leaves, _ = pytree.tree_flatten_with_path(out)
    return {"output" + pytree.keystr(k): _whole(t) for k, t in leaves if isinstance(t, torch.Tensor)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@contextlib.contextmanager
def _deterministic(on: bool, seed: int):
    """Fixed seeds and torch's deterministic algorithms (warn only where an op has none), restored after."""
    if not on:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def verify(model: torch.nn.Module, example_inputs=(), example_kwargs=None, *, grid=(2, 2), steps: int = 1,
           loss=None, optimizer=None, deterministic: bool = True, seed: int = 0, nodes: bool | str = True,
           **options) -> VerifyReport:
    """Run `model` parallelized (`autopar.parallelize(model, grid, ..., **options)`: every option,
    pipeline and data_parallel included) and unmodified on the same inputs for `steps` training steps;
    call on every rank. Compares the loss of every step, every output and parameter gradient of the first
    step (gathered whole) and every parameter after the last; on a mismatch in the first step, names the
    first graph node that differs (`autopar.debug.nodes`). Returns a `VerifyReport` (the same on every
    rank); `print(report)` shows it.

    Args:
        loss: fn(output) -> scalar, applied to both models' outputs (default: the loss the model computes,
            `.loss` or its 0-dim output). A pipeline uses the model's own loss.
        optimizer: fn(parameters) -> torch.optim.Optimizer, built for each side (default AdamW, lr 1e-3,
            eps 1e-6).
        deterministic: seed every rank with `seed` and turn on torch's deterministic algorithms for the run.
        nodes: record every node's value in the first step (memory: one copy of every activation) to name
            the first diverging node on a mismatch; 'always': compare the nodes on a clean run too (the
            report then counts them); False: no recording.
    """
    if nodes not in (True, False, "always"):
        raise UsageError(f"verify: nodes={nodes!r}; expected True (search on a mismatch), 'always' or False")
    if steps < 1:
        raise UsageError(f"verify: steps={steps}; expected at least 1 training step")
    if not dist.is_initialized():
        raise UsageError("verify: no process group; call it on every rank after torch.distributed.init_process_group "
                         "(or under `torchrun`, or `python -m autopar verify` which starts the ranks)")
    from autopar.parallel.api import parallelize

    _check_reference_fits(model)

    kwargs = dict(example_kwargs or {})
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    make_opt = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6))
    loss_fn = loss or default_loss
    with _deterministic(deterministic, seed):
        ref = copy.deepcopy(model).train()
        pm = parallelize(model, grid=grid, example_inputs=args, example_kwargs=kwargs, **options)
        pm.train()
        piped = hasattr(pm, "train_step")
        _refuse_random(pm, piped)
        dtype = next((p.dtype for p in ref.parameters() if p.is_floating_point()), torch.float32)
        rtol, frac = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
        opt, ref_opt = make_opt(pm.parameters()), make_opt(ref.parameters())
        found, losses, notes = [], [], []
        rank = dist.get_rank()
        divergence, counted = None, (0, 0)
        for step in range(steps):
            recorders: list = []
            with _observed(pm, piped, nodes and step == 0, recorders):
                if piped:
                    got_loss, outs = pm.train_step(*args, **kwargs), {}
                else:
                    out = pm(*args, **kwargs)
                    got_loss = loss_fn(out)
                    got_loss.backward()
                    outs = _leaves(out)
            ref_out = ref(*args, **kwargs)
            want_loss = (default_loss if piped else loss_fn)(ref_out)
            want_loss.backward()
            losses.append((float(_whole(got_loss)), float(want_loss.detach())))
            found += _group("loss", {f"step {step}": (_whole(got_loss), want_loss.detach())}, rank, rtol, frac)
            if step == 0:
                if outs:
                    want_outs = _leaves(ref_out)
                    found += _group("output", {k: (g, want_outs[k]) for k, g in outs.items()
                                               if g.is_floating_point() and k in want_outs}, rank, rtol, frac)
                refs = dict(ref.named_parameters(remove_duplicate=False))
                found += _group("gradient", {n: (_whole(p.grad), refs[n].grad) for n, p in pm.named_parameters()
                                             if p.grad is not None and refs[n].grad is not None}, rank, rtol, frac)
                missing = sorted(n for n, p in pm.named_parameters() if (p.grad is None) != (refs[n].grad is None))
                found += [Finding("gradient", f"{n} (None on one side)", rank, math.inf, math.inf) for n in missing]
                compiled = bool(options.get("compile")) and nodes is not False
                if compiled and (nodes == "always" or _anywhere(any(not f.ok for f in found))):
                    recorders = _eager_rerun(pm, piped, args, kwargs, loss_fn)  # the same step, node by node
                if recorders and (nodes == "always" or _anywhere(any(not f.ok for f in found))):
                    wrong = [f.name for f in found if f.category == "gradient" and not f.ok]
                    micro = pm.pipeline.n_microbatches if piped else 0
                    divergence, counted = _localize(recorders, model, args, kwargs, loss_fn, micro, wrong, rtol, frac)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        refs = dict(ref.named_parameters(remove_duplicate=False))
        found += _group("parameter", {f"{n} after {steps} step(s)": (_whole(p), refs[n])
                                      for n, p in pm.named_parameters()}, rank, rtol, frac)
    if options.get("compile") and any(not f.ok for f in found) and nodes is not False:
        notes.append("compile=True: the nodes were read from the same step run again eagerly; where none differs, "
                     "the compiled program is what differs from the eager one (a torch.compile issue)")
    return _report(found, losses, divergence, counted, (rtol, frac), notes)


def available_bytes(device: torch.device) -> int | None:
    """Free memory where the reference would live: the device's free bytes on a GPU, the host's
    MemAvailable on Linux; None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_reference_fits(model) -> None:
    """The one-process reference holds the whole model, its gradients and two AdamW states: refused, saying
    so, where that is more than the free memory (or the model has no weights yet)."""
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        raise UsageError("verify: the model's parameters are on the meta device (no values to compare); build it "
                         "with its weights (or load them) before verify")
    need = 4 * sum(p.numel() * p.element_size() for p in params)
    device = params[0].device if params else torch.device("cpu")
    free = available_bytes(device)
    if free is not None and need > free:
        raise UsageError(f"verify: the one-process reference needs about {need / 2**30:.1f} GiB (the whole model, "
                         f"its gradients and AdamW's two states) and {device} has {free / 2**30:.1f} GiB free on "
                         f"this rank; verify a smaller configuration of the same model (fewer layers: the same rules "
                         f"and collectives run per layer). A layer-by-layer mode is not built yet")


_DROPOUTS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}


def _random_nodes(gm) -> list:
    """The nodes of a program that draw random numbers with an effect: dropout with p > 0, attention
    with dropout_p > 0, and every other random op."""
    from passes.compile import RANDOM_OPS

    out = []
    for n in gm.graph.nodes:
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
        if name in _DROPOUTS:
            p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
            if p and (len(n.args) < 3 or n.args[2]):
                out.append(n)
        elif name == "scaled_dot_product_attention":
            if (n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)):
                out.append(n)
        elif name in RANDOM_OPS:
            out.append(n)
    return out


def _refuse_random(pm, piped: bool) -> None:
    stages = pm.stage_modules if piped else [pm]
    found = [n for s in stages for n in _random_nodes(s.program.inspected)]
    if found:
        names = ", ".join(sorted({f"{n.name} ({module_path(n) or 'top'})" for n in found}))
        raise UsageError(f"verify: the model draws random numbers in training ({names}): each block of the "
                         f"parallel program draws its own mask, so no step can equal one process's. Build the model "
                         f"with its dropout probabilities at 0 (e.g. config attention_dropout=0.0, "
                         f"hidden_dropout=0.0) to verify it")


@contextlib.contextmanager
def _observed(pm, piped: bool, on: bool, recorders: list, eager: bool = False):
    """Record every eager program call of the grid (or of each of this rank's pipeline stages) while on;
    `eager`: compiled programs' calls too, run eagerly."""
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for stage in (pm.stage_modules if piped else [pm]):
            rec = Recorder(first_call=piped)
            recorders.append((stage, rec))
            stack.enter_context(stage.observing(rec, eager))
        yield


def _eager_rerun(pm, piped: bool, args, kwargs, loss_fn) -> list:
    """A compiled program's first step again, eagerly and node by node, its gradients put back as they were
    (the comparison already read them; the optimizer steps on the compiled step's)."""
    saved = {id(p): (None if p.grad is None else p.grad.detach().clone()) for p in pm.parameters()}
    recorders: list = []
    with _observed(pm, piped, True, recorders, eager=True):
        if piped:
            pm.train_step(*args, **kwargs)
        else:
            loss_fn(pm(*args, **kwargs)).backward()
    for p in pm.parameters():
        p.grad = saved[id(p)]
    return recorders


def _localize(recorders: list, model, args, kwargs, loss_fn, micro: int, wrong: list, rtol, frac) -> tuple:
    """The first diverging node over the ranks (the earliest forward one, else the first in backward); where
    no node differs but gradients in `wrong` do, the first such parameter's place in the program."""
    from autopar.program.build import cache_off_kwargs

    kwargs = {**cache_off_kwargs(model), **kwargs}
    was = model.training
    model.train()
    try:
        ref, _ = reference(model, args, kwargs, default_loss if micro else loss_fn)
    finally:
        model.train(was)
    mine, compared, skipped = None, 0, 0
    for stage, rec in recorders:
        if rec.gm is None:
            continue
        d, c, s = first_divergence(rec, ref, stage.grid, rtol, frac, micro)
        compared, skipped = compared + c, skipped + s
        if d is not None and (mine is None or (d.direction, d.position) < (mine.direction, mine.position)):
            mine = d
    if mine is None and wrong:  # the parameter backward reaches first
        found = [d for stage, rec in recorders if rec.gm is not None for w in wrong
                 if (d := parameter_path(rec.gm, w, stage.grid)) is not None]
        mine = max(found, key=lambda d: d.position, default=None)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, compared, skipped))
    forward = [d for d, _, _ in every if d is not None and d.direction == "forward"]
    backward = [d for d, _, _ in every if d is not None and d.direction == "backward"]
    pick = (min(forward, key=lambda d: (d.position, d.rank)) if forward
            else max(backward, key=lambda d: (d.position, -d.rank)) if backward else None)
    return pick, every[0][1:]


def _anywhere(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank then takes the same branch: the search gathers)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, bool(flag))
    return any(every)


def _group(category: str, pairs: dict, rank: int, rtol: float, frac: float) -> list:
    """A Finding per (got, want) pair, atol scaled to the group's largest magnitude."""
    top = max((magnitude(w) for _, w in pairs.values()), default=0.0)
    out = []
    for name, (got, want) in pairs.items():
        got, want = torch.as_tensor(got), torch.as_tensor(want)
        e = excess(got, want, rtol, frac * top)
        if got.shape != want.shape:
            err = math.inf
        else:
            diff = (got.detach().double().cpu() - want.detach().double().cpu()).abs()
            err = float(diff.nan_to_num(math.inf).max()) / max(top, 1e-30) if diff.numel() else 0.0
        out.append(Finding(category, name, rank, err, e))
    return out


def _report(found: list, losses: list, divergence, counted, tolerance, notes) -> VerifyReport:
    """Every rank's findings gathered into one report, the same on every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    worst: dict = {}  # a whole gradient or parameter is compared alike on every rank that holds it: its worst
    for f in (f for fs in every for f in fs):
        key = (f.category, f.name)
        if key not in worst or (f.excess, f.error) > (worst[key].excess, worst[key].error):
            worst[key] = f
    merged = list(worst.values())
    ok = all(f.ok for f in merged)
    return VerifyReport(ok, merged, losses, divergence, tuple(counted), tolerance, notes)
