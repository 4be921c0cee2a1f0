"""A package whose public names are imported on first use: `import passes` and `import autopar` load no
torch, so `autopar --help` answers at once and the command line can read the option declarations.

`lazy_names(package_name, home)` turns the package module into one whose attribute `name` is
`home[name]`'s `name`, imported when first read; any other attribute is its submodule of that name.
Importing a submodule that shares a public name (`passes.capture`, `autopar.plan`) binds the package
attribute to the public name, as an eager `from ... import name` did.
"""

from __future__ import annotations

import importlib
import sys
import types


def lazy_names(package_name: str, home: dict, first_use: str | None = None) -> None:
    """`first_use`: a module imported with the first public name read (autopar: its checkpoint layer,
    which adds `pmodel.save_pretrained` to the parallel layer below it)."""
    pending = [first_use] if first_use else []

    class Package(types.ModuleType):
        def __getattr__(self, name):
            if name not in home:  # a submodule, as when the names above loaded them all
                try:
                    return importlib.import_module(f"{package_name}.{name}")
                except ModuleNotFoundError as e:
                    if e.name != f"{package_name}.{name}":
                        raise
                # a module __getattr__ must raise AttributeError for hasattr and `from x import y`
                raise AttributeError(f"module {package_name!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(home[name]), name)
            setattr(self, name, value)
            while pending:
                importlib.import_module(pending.pop())
            return value

        def __setattr__(self, name, value):
            if name in home and isinstance(value, types.ModuleType):
                value = getattr(importlib.import_module(home[name]), name)
            super().__setattr__(name, value)

        def __dir__(self):
            return sorted(set(super().__dir__()) | set(home))

    sys.modules[package_name].__class__ = Package
