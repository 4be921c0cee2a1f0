"""Rank-side checks of 3D tensor parallelism's linear (`passes.ops.cube`) against torch on whole
tensors (identical on every rank: same seed)."""

from __future__ import annotations

import torch

from passes.cost.cube import cube_linear_bytes
from passes.mesh import Cube
from passes.ops.cube import activation_block, cube_linear, weight_block
from tests.compare import RTOL, excess, scaled_atol


def two_linears(rank, q, lowering):
    """Z = (X W1) W2 on a q x q x q cube, the second linear reading the first's output as it is: the
    values of Y and Z, the gradients of X, W1 and W2 (loss sum(G * Z)), each rank's block against the
    same block of torch's; the bytes each linear received forward and backward, with the formula's;
    the weight elements held."""
    cube = Cube(q)
    torch.manual_seed(0)
    M, K, N, P = 4 * q, 4 * q * q, 6 * q * q, 2 * q * q
    X, W1, W2 = torch.randn(M, K), torch.randn(K, N), torch.randn(N, P)
    G = torch.randn(M, P)
    x = activation_block(cube, X).requires_grad_()
    w1, w2 = weight_block(cube, W1).requires_grad_(), weight_block(cube, W2).requires_grad_()
    cube.log.reset()
    y = cube_linear(cube, x, w1, "l1", lowering=lowering)
    z = cube_linear(cube, y, w2, "l2", lowering=lowering)
    (z * activation_block(cube, G)).sum().backward()
    Xf, W1f, W2f = (t.clone().requires_grad_() for t in (X, W1, W2))
    Yf = Xf @ W1f
    Zf = Yf @ W2f
    (Zf * G).sum().backward()
    errs = {"Y": excess(y, activation_block(cube, Yf.detach()), RTOL, scaled_atol([Yf])),
            "Z": excess(z, activation_block(cube, Zf.detach()), RTOL, scaled_atol([Zf])),
            "dX": excess(x.grad, activation_block(cube, Xf.grad), RTOL, scaled_atol([Xf.grad])),
            "dW1": excess(w1.grad, weight_block(cube, W1f.grad), RTOL, scaled_atol([W1f.grad])),
            "dW2": excess(w2.grad, weight_block(cube, W2f.grad), RTOL, scaled_atol([W2f.grad]))}
    counted = {tag: (cube.log.bytes[(tag, "fwd")], cube.log.bytes[(tag, "bwd")]) for tag in ("l1", "l2")}
    formula = {"l1": cube_linear_bytes(M, K, N, q, 4), "l2": cube_linear_bytes(M, N, P, q, 4)}
    return {"excess": errs, "counted": counted, "formula": formula, "at": (cube.r, cube.c, cube.l),
            "held": (w1.numel(), w2.numel()), "whole": (W1.numel(), W2.numel())}


def refusals(rank):
    """The 3D linear's errors for blocks that do not fit the cube, and parallelize's for a grid that is
    not a cube or a cube with pipeline stages: (type name, message)."""
    import autopar
    from passes.errors import UsageError

    cube = Cube(2)
    out = {}
    model, x = torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.randn(4, 16)
    for name, kw in (("grid 2x4", dict(grid=(2, 4))), ("grid 2x2x1", dict(grid=(2, 2, 1))),
                     ("pipeline", dict(grid=(2, 2, 2), pipeline=2)),
                     ("shard", dict(grid=(2, 2, 2), data_parallel="shard"))):
        try:
            autopar.parallelize(model, example_inputs=(x,), strategy="3d", **kw)
            out[name] = ("none", "")
        except UsageError as e:
            out[name] = (type(e).__name__, str(e))
    for name, kw in (("count 4", dict(grid=4, strategy="auto")), ("count 2d", dict(grid=8, strategy="2d")),
                     ("count pipeline", dict(grid=8, strategy="auto", pipeline=2))):
        try:
            autopar.parallelize(model, example_inputs=(x,), **kw)
            out[name] = ("none", "")
        except UsageError as e:
            out[name] = (type(e).__name__, str(e))
    for name, x, w in (("mismatch", torch.randn(4, 3), torch.randn(2, 3)),
                       ("uneven N", torch.randn(4, 2), torch.randn(2, 3))):
        try:
            cube_linear(cube, x, w, name, lowering="broadcast")
            out[name] = ("none", "")
        except UsageError as e:
            out[name] = (type(e).__name__, str(e))
    return out


def _counted_and_planned(pm) -> tuple:
    """({node: (module op, bytes counted in the last step, bytes the plan prices)} for every SUMMA or 3D
    linear of `pm`'s program, (the plan's total, the step's)), the plan priced at this rank's grid
    position; the totals leave out a mixture of experts' routing ops, whose bytes follow the tokens
    the router sends to each row (the plan prices an even routing; tests/test_moe.py recounts them)."""
    from autopar.planning.explain import graph_rows

    log = pm.grid.log
    table = graph_rows(pm.program.inspected, pm.grid.shape, at=(pm.grid.r, pm.grid.c))
    def planned(r):  # with recompute=..., a recomputed forward receives its bytes again in backward
        return r.fwd_bytes + r.bwd_bytes + r.recompute_bytes

    linears = {r.node: (r.op.split("(")[0], sum(v for (tag, _), v in log.bytes.items() if tag == r.node), planned(r))
               for r in table if r.op.startswith(("CubeLinear", "SummaLinear"))}
    routed = (sum(planned(r) for r in table if r.op.startswith("Expert")),
              sum(v for (tag, _), v in log.bytes.items() if tag.startswith("moe:")))  # MoE dispatch: data-dependent
    return linears, (sum(planned(r) for r in table) - routed[0], log.total() - routed[1])


def _searched_cube(model, kwargs, mix: dict):
    """A stand-in for the arrangement search that returns the 2x2x2 cube with each unit under the
    option `mix` names for the end of its key (a Choice as `passes.search.strategy.choose` makes)."""
    from autopar.planning.grids import GridChoice
    from autopar.program.build import capture
    from passes.search import strategy as strategies

    units = strategies.find_units(capture(model, (), kwargs).gm)
    assignment = {u.key: next(o for end, o in mix.items() if u.key.endswith(end)) for u in units}
    alternatives = {k: {o: 0.0} for k, o in assignment.items()}
    choice = strategies.Choice(assignment, strategies.Estimate(), alternatives, {}, 0, {})
    return GridChoice((2, 2, 2), [{"grid": (2, 2, 2), "layout": "3d", "picked": True, "choice": choice}])


def model_steps(rank, family, over=None, steps=3, batch=4, seq=8, mix=None, options=None):
    """A model on a 2x2x2 cube (strategy='3d') against one process: loss, logits and every gradient
    after the first step, parameters after `steps` AdamW steps; per linear, the bytes counted in the
    first step next to the plan's. `family`: 'tinygpt' (the repo's GPT, `over` its config) or a
    transformers family of tests/checks_hf.py (or 'mixtral', examples/hf_families.py's); `options`:
    more keywords for parallelize. `mix` (unit key ending -> option): parallelize(grid=8,
    strategy='auto') instead, its arrangement search answering the cube with that per-unit mix;
    mix='search': parallelize(grid=8, strategy='auto') with the search as it is."""
    import copy
    import warnings

    import autopar
    from tests.compare import group_excess

    torch.manual_seed(0)
    if family == "tinygpt":
        from models import GPTConfig, TinyGPT

        cfg = GPTConfig(**over)
        model = TinyGPT(cfg)

        def make(b, s, seed):
            g = torch.Generator().manual_seed(seed)
            return dict(ids=torch.randint(0, cfg.vocab_size, (b, s), generator=g),
                        targets=torch.randint(0, cfg.vocab_size, (b, s), generator=g))
    elif family == "mixtral":  # experts routed per token (examples/hf_families.py's tiny Mixtral)
        import hf_families

        model, make = hf_families.build(family, **(over or {}))
    else:
        from tests.checks_hf import build

        model, make = build(family, **(over or {}))
    model.eval()  # dropout off: one process and the cube compute the same function
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mix == "search":  # the arrangement search itself
            pm = autopar.parallelize(model, grid=8, example_kwargs=make(batch, seq, 1), strategy="auto")
        elif mix is None:
            pm = autopar.parallelize(model, grid=(2, 2, 2), example_kwargs=make(batch, seq, 1), strategy="3d",
                                     **(options or {}))
        else:
            import autopar.parallel.arrange as arrange

            search = arrange.search_grids
            arrange.search_grids = lambda m, p, args, kw, *a, **k: _searched_cube(m, kw, mix)
            try:
                pm = autopar.parallelize(model, grid=8, example_kwargs=make(batch, seq, 1), strategy="auto")
            finally:
                arrange.search_grids = search
    warned = [str(w.message) for w in caught if issubclass(w.category, autopar.PlanWarning)]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    ref_params = dict(ref.named_parameters())
    errs, linears, totals = {}, {}, (0, 0)
    for step in range(steps):
        kw = make(batch, seq, step + 1)
        pm.grid.log.reset()
        out, want = pm(**kw), ref(**kw)
        loss, ref_loss = (out[1], want[1]) if family == "tinygpt" else (out.loss, want.loss)
        logits, ref_logits = (out[0], want[0]) if family == "tinygpt" else (out.logits, want.logits)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            full = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)  # noqa: E731
            errs.update(group_excess({"logits": (full(logits), ref_logits.detach())}))
            errs.update(group_excess({"loss": (full(loss), ref_loss.detach())}))
            errs.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                     prefix="grad "))
            linears, totals = _counted_and_planned(pm)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    errs.update(group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()},
                             prefix=f"param after {steps} steps "))
    held = {n: (p.to_local().numel(), p.numel(), len(p.placements)) for n, p in pm.named_parameters() if p.dim() == 2}
    return {"excess": errs, "linears": linears, "held": held, "warned": warned, "totals": totals,
            "grid": (pm.grid.shape, pm.grid.cube is not None),
            "compiled": tuple(pm.compile_stats.get(pm.program.signature, ())),  # compile=True: (graphs, breaks)
            "names match": sorted(n for n, _ in pm.named_parameters()) == sorted(ref_params),
            "explain": autopar.explain(pm).splitlines() if mix == "search" else []}  # a stand-in search: no table


def checkpoints(rank, tmp):
    """A Llama on a 2x2x2 cube after one AdamW step, saved with torch.distributed.checkpoint (model
    and optimizer) and with save_pretrained: each read back by a fresh cube model, by a 2x4 grid and
    (save_pretrained) by autopar.from_pretrained on the cube; every parameter, whole, against the
    saved model's (bit equality: nothing is computed), and AdamW's states after the cube reload."""
    import copy
    import warnings

    import autopar
    from tests.checks_hf import build

    torch.manual_seed(0)
    model, make = build("llama")
    kw = make(4, 8, 1)

    def par(m, **options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.parallelize(copy.deepcopy(m), example_kwargs=kw, **options)

    pm = par(model, grid=(2, 2, 2), strategy="3d")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(**kw).loss.backward()
    opt.step()
    want = {n: p.full_tensor() for n, p in pm.named_parameters()}
    states = {n: {k: v.full_tensor() for k, v in opt.state[p].items() if hasattr(v, "full_tensor")}
              for n, p in pm.named_parameters()}
    autopar.save_distributed(pm, f"{tmp}/dcp", optimizer=opt)
    autopar.save_pretrained(pm, f"{tmp}/hf")
    errs = {}

    def same(tag, other):
        for n, p in other.named_parameters():
            errs[f"{tag} {n}"] = excess(p.full_tensor(), want[n], 0.0, 0.0)

    cube = par(model, grid=(2, 2, 2), strategy="3d")
    cube_opt = torch.optim.AdamW(cube.parameters(), lr=1e-3)
    autopar.load_distributed(cube, f"{tmp}/dcp", optimizer=cube_opt)
    same("dcp -> cube", cube)
    for n, p in cube.named_parameters():
        for k, v in states[n].items():
            errs[f"dcp -> cube adamw {k} {n}"] = excess(cube_opt.state[p][k].full_tensor(), v, 0.0, 0.0)
    flat = par(model, grid=(2, 4))
    autopar.load_distributed(flat, f"{tmp}/dcp")
    same("dcp -> 2x4", flat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read = autopar.from_pretrained(f"{tmp}/hf", grid=(2, 2, 2), example_kwargs=kw, strategy="3d", progress=False)
    same("save_pretrained -> from_pretrained cube", read)
    return errs
