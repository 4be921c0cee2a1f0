"""The house rules of the code, read from the source with `ast`: no import cycles, imports only go down
the layer order of docs/design.md, no module imports another's private names (nor do tests and
examples read them), and private torch APIs only in passes/compat.py. Every import counts: module
level, inside functions, under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("passes", "autopar")

# Low to high; a module may import its own unit (folder or leaf module) and any unit of a lower layer.
# docs/design.md ("Layers") writes the same order; test_layer_order_is_documented keeps them equal.
LAYERS = [
    ("passes.errors", "passes.lazy"),
    ("passes.compat", "passes.meta"),
    ("passes.layout", "passes.mesh", "passes.nodes"),
    ("passes.cost",),
    ("passes.options",),
    ("passes.capture", "passes.ops"),
    ("passes.kernels",),
    ("passes.rules",),
    ("passes.transforms",),
    ("passes.search",),
    ("passes.compile",),
    ("passes",),
    ("autopar.errors", "autopar.launch", "autopar.moved"),
    ("autopar.program",),
    ("autopar.generate",),
    ("autopar.planning",),
    ("autopar.parallel",),
    ("autopar.checkpoint",),
    ("autopar.hf", "autopar.debug"),
    ("autopar",),
    ("autopar.bench",),
    ("autopar.cli",),
    ("autopar.__main__",),
]


def modules() -> dict:
    """dotted name -> path of every module of both packages."""
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def imports(path: str, mods: dict) -> list:
    """(line, imported module, names taken from it) for every import in the file, resolved to modules
    of the two packages: `from passes.ops import comm` is an import of passes.ops.comm."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            plain = []
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in mods:
                    out.append((node.lineno, sub, ()))
                else:
                    plain.append(a.name)
            if plain:
                out.append((node.lineno, node.module, tuple(plain)))
    return out


def graph() -> tuple:
    mods = modules()
    return mods, {m: imports(p, mods) for m, p in mods.items()}


def unit(mod: str) -> str:
    """The layer unit a module belongs to: the longest listed prefix."""
    best = max((u for layer in LAYERS for u in layer if mod == u or mod.startswith(u + ".")), key=len)
    return best


def layer(u: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if u in units)


def cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """Catches an import that closes a loop, at module level or late inside a function."""
    mods, imps = graph()
    edges = {m: {t for _, t, _ in imps[m] if t in mods} for m in mods}
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_go_down_the_layers():
    """Catches an import from a lower layer to a higher one (the compiler importing autopar, a rule
    importing a transform), and a module importing the package face above it."""
    mods, imps = graph()
    bad = []
    for m, found in imps.items():
        mine = unit(m)
        for line, target, _ in found:
            if target not in mods:
                continue
            theirs = unit(target)
            if theirs != mine and layer(theirs) >= layer(mine):
                bad.append(f"{mods[m]}:{line}: {m} ({mine}) imports {target} ({theirs})")
    assert not bad, "imports against the layer order (docs/design.md, Layers):\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    """Catches `from passes.ops.comm import _nbytes` and friends: what another module needs is public."""
    mods, imps = graph()
    bad = [f"{mods[m]}:{line}: {m} imports {n} from {t}" for m, found in imps.items() for line, t, names in found
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def parallel_module_privates() -> set:
    """ParallelModule's private attributes and methods (`self._x = ...`, `def _x`), read off its source."""
    tree = ast.parse(open(os.path.join(ROOT, "autopar", "parallel", "module.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ParallelModule")
    out = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and _private(n.name)}
    out |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    out |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    out |= {n.args[1].value for n in ast.walk(cls) if isinstance(n, ast.Call)  # object.__setattr__(self, "_x", v)
            and ast.unparse(n.func) == "object.__setattr__" and isinstance(n.args[1], ast.Constant)}
    return {n for n in out if _private(n)}


def test_no_private_names_in_tests_and_examples():
    """Catches a test or example that reaches into autopar's private names (`from autopar.checkpoint.hf
    import _files`, `cli._parser()`, `pmodel._compiled`): what they need is public, so a rename inside
    a module cannot break them unseen."""
    mods = modules()
    pm_privates = parallel_module_privates()
    bad = []
    for folder in ("tests", "examples"):
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                bad += [f"{path}:{line}: imports {n} from {t}" for line, t, names in imports(path, mods)
                        for n in names if _private(n)]
                tree = ast.parse(open(path).read(), path)
                bound = {}  # local name -> the module of ours it names
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        bound.update((a.asname, a.name) if a.asname else (a.name.split(".")[0],) * 2
                                     for a in node.names if a.name.split(".")[0] in PACKAGES)
                    elif isinstance(node, ast.ImportFrom) and node.module:
                        bound.update((a.asname or a.name, f"{node.module}.{a.name}") for a in node.names
                                     if f"{node.module}.{a.name}" in mods)
                for node in ast.walk(tree):
                    if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                        continue
                    owner = ast.unparse(node.value)
                    head, _, rest = owner.partition(".")
                    module = bound.get(head, "") + ("." + rest if rest else "")
                    if module in mods and f"{module}.{node.attr}" not in mods:
                        bad.append(f"{path}:{node.lineno}: reads {node.attr} of {module}")
                    elif node.attr in pm_privates and owner not in ("self", "cls"):
                        bad.append(f"{path}:{node.lineno}: reads {owner}.{node.attr} (private to ParallelModule)")
    assert not bad, "\n".join(bad)


PRIVATE_TORCH = re.compile(r"\btorch(\.\w+)*\._[a-z]\w*")


def test_private_torch_apis_only_in_compat():
    """Catches a private torch API (torch._dynamo, torch.distributed._functional_collectives, ...) used
    outside passes/compat.py, where each is listed with the version it was checked on."""
    mods, _ = graph()
    bad = []
    for m, path in mods.items():
        if m == "passes.compat":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            name = None
            if isinstance(node, ast.ImportFrom) and node.module:
                name = node.module + "." + ".".join(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                name = " ".join(a.name for a in node.names)
            elif isinstance(node, ast.Attribute):
                name = ast.unparse(node)
            if name and PRIVATE_TORCH.search(name) and not name.startswith("torch.ops.") \
                    and name.startswith("torch"):
                bad.append(f"{path}:{node.lineno}: {name}")
    assert not bad, "private torch APIs outside passes/compat.py:\n" + "\n".join(sorted(set(bad)))


def test_layer_order_is_documented():
    """Catches docs/design.md's layer list drifting from the order this test enforces."""
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    listed = [tuple(re.findall(r"`([\w.]+)`", line)) for line in section.splitlines() if line.startswith("- `")]
    assert listed == list(reversed(LAYERS)), listed


MAX_LINES = 450  # a module longer than this holds more than one concept: split it by concept


def test_no_module_over_the_size_limit():
    """Catches a module growing past what a reader takes in at once (the house rule in docs/design.md)."""
    mods, _ = graph()
    big = {m: n for m, p in mods.items() if (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
