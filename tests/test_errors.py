"""One hierarchy of errors and warnings: whatever autopar raises derives from `autopar.AutoparError`
(and from the builtin it replaced), whatever it warns from `autopar.AutoparWarning`. Read from the
source with `ast`, then checked on one process."""

from __future__ import annotations

import ast
import builtins
import functools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import autopar
import passes
from passes import errors as compiler_errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}

# builtin exceptions raised on purpose, each with why it is not one of ours
RAISED_BUILTINS = {
    ("*", "SystemExit"): "a command's exit status and message (autopar's CLI, python -m autopar.bench.*)",
    ("passes/lazy.py", "AttributeError"): "a module __getattr__ must raise it for hasattr and imports",
    ("autopar/checkpoint/keys.py", "ImportError"): "caught by the `except ImportError` around it, which "
                                                   "raises TransformersVersionError",
    ("passes/capture/regions.py", "AssertionError"): "an invariant of ours: a region body ends in an output",
    ("passes/kernels/spec.py", "NotImplementedError"): "the abstract KernelSpec.build every kernel overrides",
}
# exception classes of ours outside the hierarchy: control flow that never leaves the compiler
INTERNAL = {
    "Unsupported": "a rule's answer 'no split form' (passes/rules/registry.py), caught by propagate",
    "_OutOfTime": "stops the strategy search at its budget (passes/search/strategy.py), caught there",
}
# warn calls whose category is a variable, and where it comes from
PASSED_CATEGORY = {("passes/mesh.py", "warn"): "passes.mesh.warn's own category, typed type[AutoparWarning]"}


@functools.lru_cache(maxsize=None)
def sources() -> dict:
    """path relative to the repository -> parsed module, for both packages."""
    out = {}
    for pkg in ("autopar", "passes"):
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    out[os.path.relpath(path, ROOT)] = ast.parse(open(path).read(), path)
    return out


def classes(trees: dict) -> dict:
    """class name -> base names (the last dotted part) of every class the packages define."""
    out = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
    return out


def descends(name: str, roots: set, bases: dict) -> bool:
    return name in roots or any(descends(b, roots, bases) for b in bases.get(name, ()) if b != name)


def functions(tree) -> dict:
    """node -> the name of the function it is in ('' at module level)."""
    out = {}

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            out[child] = inner
            visit(child, inner)

    visit(tree, "")
    return out


def test_every_raised_builtin_is_allowed():
    """Catches a `raise ValueError(...)` (or a RuntimeError, a `raise type(e)(...)`, a builtin error
    built and raised later) added to autopar: `except autopar.AutoparError` would miss it."""
    bad = []
    for path, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name):  # `raise SystemExit`
                name = node.exc.id
            elif isinstance(node, ast.Call):  # raised here, or built and raised later
                name = ast.unparse(node.func)
            else:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and ast.unparse(node.func.func) == "type":
                bad.append(f"{path}:{node.lineno}: {name}(...) is whatever type came in")
            elif name in BUILTIN_EXCEPTIONS and not {(path, name), ("*", name)} & set(RAISED_BUILTINS):
                bad.append(f"{path}:{node.lineno}: {name}")
    assert not bad, "builtin exceptions raised instead of autopar's (passes/errors.py, autopar/errors.py):\n" \
        + "\n".join(sorted(set(bad)))


def test_every_exception_class_is_in_the_hierarchy():
    """Catches a new `class FooError(ValueError)` (or a warning of its own) beside the hierarchy, and a
    class of ours that lost its builtin base (`except ValueError` written before would miss it)."""
    bases = classes(sources())
    exceptions = {n for n in bases if descends(n, BUILTIN_EXCEPTIONS | {"Exception"}, bases)}
    bad = [n for n in sorted(exceptions - set(INTERNAL)) if not descends(n, {"AutoparError", "AutoparWarning"}, bases)]
    bad += [n for n in sorted(bases) if n.endswith(("Error", "Warning")) and n not in exceptions]
    assert not bad, f"exception classes outside AutoparError / AutoparWarning: {bad}"
    for name in autopar.errors.__all__:
        cls = getattr(autopar.errors, name)
        if issubclass(cls, autopar.AutoparError) and cls is not autopar.AutoparError:
            assert any(b.__module__ == "builtins" and b not in (Exception, BaseException, object)
                       for b in cls.__mro__), f"{name} derives from no builtin error that code could catch"


def test_every_warning_is_ours():
    """Catches a `warnings.warn(text)` (a bare UserWarning) or a builtin category: a filter on
    autopar.AutoparWarning would not see it."""
    bases = classes(sources())
    mine = {n for n in bases if descends(n, {"AutoparWarning"}, bases)}
    bad = []
    for path, tree in sources().items():
        within = functions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) in ("warnings.warn", "warn")):
                continue
            given = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "category"), None)
            name = ast.unparse(given).split(".")[-1] if given is not None else "UserWarning"
            if name not in mine and (path, within.get(node)) not in PASSED_CATEGORY:
                bad.append(f"{path}:{node.lineno}: {name}")
    assert not bad, "warnings outside AutoparWarning:\n" + "\n".join(bad)


def test_one_except_catches_bad_options_grids_and_captures():
    """Catches an error a user sees that `except autopar.AutoparError` misses, or that stopped being
    the ValueError / RuntimeError code written before the hierarchy catches."""
    with pytest.raises(autopar.AutoparError, match="lowering='x'") as e:
        passes.options.Options(lowering="x")
    assert isinstance(e.value, ValueError) and type(e.value) is autopar.UsageError
    with pytest.raises(autopar.UsageError, match=r"grid=\(True, 4\): expected \(R, C\) of positive ints"):
        autopar.parallelize(torch.nn.Linear(4, 4), grid=(True, 4), example_inputs=(torch.ones(2, 4),))
    with pytest.raises(autopar.NoProcessGroupError, match="needs torch.distributed") as e:
        autopar.parallelize(torch.nn.Linear(4, 4), grid=(2, 2), example_inputs=(torch.ones(2, 4),))
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, autopar.AutoparError)

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(autopar.AutoparError, match="could not capture DataDependent") as e:
        passes.capture(DataDependent(), (torch.ones(2),))
    assert isinstance(e.value, autopar.CaptureError) and isinstance(e.value, RuntimeError)


def test_memory_limits_and_other_ranks_errors_are_ours():
    """Catches a memory refusal that `except MemoryError` or `except AutoparError` misses, and an error
    agreed between ranks that comes back as a builtin (or as a bare RuntimeError for one of ours)."""
    from autopar.generate.phases import phase_options
    from autopar.program.consensus import agree

    with pytest.raises(MemoryError, match="leaves nothing for a phase's own plan") as e:
        phase_options(passes.options.Options(strategy="auto", memory_limit=100), "auto", stored_bytes=300)
    assert isinstance(e.value, autopar.MemoryLimitError)

    class CheckpointException(Exception):
        """A stand-in for torch.distributed.checkpoint's error, which autopar has no class for."""

    one = SimpleNamespace(rank=0)
    for failure, cls, builtin in ((OSError(28, "No space left on device"), autopar.CheckpointFileError, OSError),
                                  (FileNotFoundError("gone"), autopar.CheckpointNotFoundError, FileNotFoundError),
                                  (autopar.ShardingError("q"), autopar.ShardingError, ValueError),
                                  (CheckpointException("write"), autopar.RankFailedError, RuntimeError)):
        with pytest.raises(autopar.AutoparError, match="^saving failed on rank 0") as e:
            agree(one, failure, "saving")
        assert type(e.value) is cls and isinstance(e.value, builtin), (failure, e.value)


def test_a_search_on_one_rank_reaches_or_fails_every_rank():
    """`decided_once` (rank 0's strategy search and its arrangement of the ranks, sent to every rank):
    catches a search error raised on the searcher alone (the others would wait in the broadcast until
    the timeout), one that reaches the others as another class or text, and a search run again off
    the searcher. The broadcast is simulated: every other rank's box receives the searcher's."""
    import contextlib

    from autopar.program.consensus import decided_once

    sent: list = []
    searcher = (True, lambda box: sent.__setitem__(slice(None), box))
    other = (False, lambda box: box.__setitem__(0, sent[0]))

    def never():
        raise AssertionError("searched off the searcher")

    assert decided_once(lambda: (2, 4), *searcher, contextlib.nullcontext()) == (2, 4)
    assert decided_once(never, *other, contextlib.nullcontext()) == (2, 4)

    def too_small():
        raise autopar.MemoryLimitError("no arrangement of 8 devices fits memory_limit=1.0 MiB per rank")

    def broken():
        raise KeyError("grid")

    for search, cls, text in ((too_small, autopar.MemoryLimitError, "^no arrangement of 8 devices fits"),
                              (broken, autopar.RankFailedError, "'grid'")):
        for rank in (searcher, other):
            with pytest.raises(cls, match=text):
                decided_once(search if rank is searcher else never, *rank, contextlib.nullcontext())


def test_old_names_keep_working():
    """Catches a move of an error class that breaks code importing it from where it was."""
    from passes.capture.export import CaptureError
    from passes.layout import ShardingError
    from passes.ops.comm import CollectiveError

    assert autopar.ShardingError is compiler_errors.ShardingError is ShardingError is passes.ShardingError
    assert autopar.CollectiveError is CollectiveError and autopar.CaptureError is CaptureError
    for name in autopar.errors.__all__:
        assert getattr(autopar, name) is getattr(autopar.errors, name), name
    assert issubclass(autopar.ShardingError, ValueError) and issubclass(autopar.MovedWarning, DeprecationWarning)


def test_a_moved_path_warns_with_ours():
    """Catches the moved-path notice given as a plain DeprecationWarning, or not at all."""
    code = ("import warnings\nwith warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n    import autopar.report\n"
            "print([w.category.__name__ for w in caught if 'moved to' in str(w.message)])")
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "['MovedWarning']", out
