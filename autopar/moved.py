"""Module paths of earlier releases, kept importing for one release with a MovedWarning (a
DeprecationWarning).

`import autopar.api` (or `python -m autopar.bench_compile`) finds the module at its new path, warns
once naming that path, and binds the old name to the same module object: classes and functions are
the ones the new path defines, so `isinstance` checks and monkeypatches see one definition.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old path -> new path; removed in the release after 0.1
MOVED = {
    "autopar.api": "autopar.parallel.api",
    "autopar.pipeline": "autopar.program.build",
    "autopar.outputs": "autopar.program.outputs",
    "autopar.guards": "autopar.program.guards",
    "autopar.agree": "autopar.program.consensus",
    "autopar.uneven": "autopar.program.uneven",
    "autopar.generate_phases": "autopar.generate.phases",
    "autopar.generate_plan": "autopar.generate.plan",
    "autopar.plan": "autopar.planning.plan",
    "autopar.explain": "autopar.planning.explain",
    "autopar.report": "autopar.planning.report",
    "autopar.capacity": "autopar.planning.capacity",
    "autopar.calibrate": "autopar.planning.calibrate",
    "autopar.hf_compat": "autopar.parallel.hf_compat",
    "autopar.distributed_checkpoint": "autopar.checkpoint.dcp",
    "autopar.files": "autopar.checkpoint.files",
    "autopar.hf_keys": "autopar.checkpoint.keys",
    "autopar.safetensors_io": "autopar.checkpoint.safetensors_io",
    "autopar.trainer": "autopar.hf.trainer",
    "autopar.bench_generate": "autopar.bench.generate",
    "autopar.bench_moe": "autopar.bench.moe",
    "autopar.bench_compile": "autopar.bench.compile",
}


def _warn(old: str, new: str) -> None:
    # imported here, not above: `autopar --help` loads this module and must not load torch, which
    # passes.errors' package does; an old path's module loads it anyway
    from passes.errors import MovedWarning

    warnings.warn(f"{old} moved to {new}; the old path stops importing in the next release",
                  MovedWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        _warn(self.old, self.new)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # the import system sets the old path's spec on it; put this one back
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the module ran at its new path already

    def get_code(self, fullname):
        """`python -m old.path`: run the new module as __main__."""
        return compile(f"import runpy, warnings\nfrom passes.errors import MovedWarning\n"
                       f"warnings.warn({self.old!r} + ' moved to ' + {self.new!r}, MovedWarning)\n"
                       f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)",
                       f"<{self.old} -> {self.new}>", "exec")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
