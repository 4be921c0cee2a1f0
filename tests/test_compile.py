"""Training under torch.compile (CPU inductor) on real gloo processes: torch.compile(pmodel) and
parallelize(..., compile=True) give one process's loss, gradients and parameters after optimizer
steps (fp32, rtol 1e-4), at 2x2 and 1x4."""

import pytest

from tests import checks_compile as C
from tests.compare import assert_every_rank

# compile is slow on 2 cores (each case compiles forward and backward on 4 ranks): the cases cover
# each model, each way of asking for compile, each grid shape, both optimizers and every lowering
# (all-gather: Llama's q|k|v and gate|up run as grouped SUMMA products) once
CASES = [
    ("tinygpt", (2, 2), "torch.compile", "adamw", "broadcast"),
    ("tinygpt", (1, 4), "option", "sgd", "broadcast"),
    ("llama", (2, 2), "option", "adamw", "allgather"),
    ("gpt2", (1, 4), "torch.compile", "adamw", "broadcast"),
    ("tinygpt", (2, 2), "option", "adamw", "ring"),
]


@pytest.mark.parametrize("name,grid,how,opt,lowering", CASES)
def test_compiled_training_parity(pool4, name, grid, how, opt, lowering):
    """Catches a kernel whose saved tensors alias its inputs or outputs (refused by dynamo inside an
    autograd.Function), a compiled region that reorders or drops a collective, and a compiled backward
    that differs from the eager one."""
    res = pool4.run(C.compile_parity, name, grid, how, opt, lowering=lowering)
    assert_every_rank([r["excess"] for r in res], f"{name} at {grid} via {how}, {opt}")
    for rank, r in enumerate(res):
        assert not r["fell back"], (rank, r["fell back"])  # compiled, not run eagerly after a failure
        # the collectives run between the compiled regions: every step moves the eager step's bytes
        assert r["step bytes"] == [r["eager bytes"]] * len(r["step bytes"]), (rank, r)
        # either way of asking compiles the per-rank program once, collectives traced: one graph, no
        # break, no recompile over the steps (torch.compile(pmodel) does not trace autopar's Python)
        assert r["compile stats"] == (1, 0), (rank, r["compile stats"])
        assert (r["graphs"], r["breaks"]) == (1, 0), (rank, r["graphs"], r["breaks"])
        # rank 0 says that it compiles and how long it took (a cold compile ran 25 min unannounced)
        said = r["progress"]
        assert ("compiling a program with torch.compile" in said and "compiled in" in said) == (rank == 0), \
            (rank, said)
        if name in ("tinygpt", "llama"):  # the compiled program checks ids and targets too
            kind, msg = r["out of range"] or (None, "")
            assert kind == "IndexRangeError" and "is outside [0, " in msg, (rank, r["out of range"])


def test_compile_failure_runs_eagerly_with_one_warning(pool4):
    """A program torch.compile cannot compile must not crash training: it runs eagerly, saying so once
    (on rank 0; the other ranks pass it through their filters without showing it)."""
    res = pool4.run(C.compile_fallback)
    assert_every_rank([r["excess"] for r in res], "eager fallback")
    assert len(res[0]["warnings"]) == 1 and "runs eagerly" in res[0]["warnings"][0], res[0]["warnings"]
    for rank, r in enumerate(res[1:], start=1):
        assert r["warnings"] == [], (rank, r["warnings"])


def test_compile_option_is_validated():
    from passes.options import Options

    with pytest.raises(ValueError, match="compile='yes'"):
        Options(compile="yes")


def _assert_one_graph(res, case):
    """The compiled step of every rank gave one process's loss and gradients, made one graph, no
    break, and launched the eager step's collectives: the same bytes and calls, in the same order;
    inductor's FX graph cache took its graphs (none bypassed it)."""
    assert_every_rank([r["excess"] for r in res], f"{case}: compiled step against one process")
    for rank, r in enumerate(res):
        assert not r["fell back"], (case, rank, r["fell back"])
        assert r["stats"] == (1, 0), f"{case}: rank {rank}: (graphs, graph breaks) = {r['stats']}, want one graph"
        assert r["line"] == ["torch.compile: 1 graph(s), 0 graph break(s)"], (case, r["line"])
        (bytes_, calls, order), eager = r["compiled log"], r["eager log"]
        assert (bytes_, calls) == eager[:2], f"{case}: rank {rank}: bytes and launches of the compiled step differ"
        assert order == eager[2], f"{case}: rank {rank}: the compiled step launched its collectives in another " \
            f"order\n  compiled {order}\n  eager    {eager[2]}"
        # every graph may be kept by inductor's FX graph cache (a restarted job finds it there)
        cache = r["cache"]
        assert cache["bypass"] == 0 and cache["hit"] + cache["miss"] > 0, f"{case}: rank {rank}: FX graph cache {cache}"


# the MLP at 1x4 is checked by test_a_new_shape_compiles_once, which compiles the same program first
@pytest.mark.parametrize("name,grid", [("tinygpt", (2, 2)), ("gpt2", (2, 2)), ("gpt2 uneven", (2, 2))])
def test_compiled_program_has_no_graph_breaks(pool4, name, grid):
    """Catches a collective or SUMMA kernel dynamo cannot trace (a graph break at every call, the
    collectives then run between compiled regions), and a traced collective that the compiled step
    drops, repeats, counts differently or launches in another order than the eager step ('gpt2
    uneven': the reblocking all-to-all and SUMMA over unequal vocabulary blocks, where the two grid
    columns compile different graphs: inductor free to reorder, they would launch in different orders
    and hang)."""
    _assert_one_graph(pool4.run(C.compile_graphs, name, grid), f"{name} at {grid}")


def test_compiled_collectives_keep_the_program_order(pool4):
    """Catches collectives that inductor may drop (a result nobody reads) or reorder (no data
    dependency between them): ranks compiling different graphs would then launch different sequences
    and hang. The ops are declared ORDERED-effectful (`passes.compat.register_ordered`)."""
    want = [("first", "fwd"), ("unused", "fwd"), ("independent", "fwd")]
    for rank, (eager, compiled) in enumerate(pool4.run(C.kept_order)):
        assert eager == want and compiled == want, f"rank {rank}: eager {eager}, compiled {compiled}"


def test_a_new_shape_compiles_once(pool4):
    """Catches a program recompiled on every call, or on every return to a shape already seen (guards
    that fail on a value that changes per call). Its first step is the checks of
    test_compiled_program_has_no_graph_breaks on the MLP at 2x2 (one process's loss and gradients, one
    graph, the eager step's SUMMA collectives in their order): the fast tier's parity check of
    parallelize(compile=True); the compiled TinyGPT, Llama and GPT-2 cases are the slow tier's."""
    res = pool4.run(C.compile_graphs, "mlp", (2, 2), batches=(6, 4, 6))
    _assert_one_graph(res, "mlp at (2, 2)")
    for rank, r in enumerate(res):
        assert r["seen"] == [1, 2, 2, 2], f"rank {rank}: graphs compiled after each step {r['seen']}, want [1, 2, 2, 2]"


def test_effect_order_wrap_when_inductor_is_loaded_first():
    """Catches the order fix missing when a user's process loaded inductor before autopar's ops (the
    import hook covers only a later first import): the with_effects lowering must be wrapped either
    way. `passes.ops.library` is what parallelize loads to insert the collectives."""
    import subprocess
    import sys

    code = ("import torch, torch._inductor.lowering as L\n"
            "before = getattr(L.lowerings[torch.ops.higher_order.with_effects], '_autopar_effect_order', False)\n"
            "import passes.ops.library\n"
            "after = getattr(L.lowerings[torch.ops.higher_order.with_effects], '_autopar_effect_order', False)\n"
            "print(before, after)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout
