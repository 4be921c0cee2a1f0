"""The autopar compiler: capture, layouts, per-op rules, propagation, collective insertion,
localization, and the runtime ops those passes insert. It never imports `autopar`.

The names below are imported on first use, so that a module that needs no torch (`passes.options`,
whose declarations the command line builds its flags from) imports without loading it.
"""

import importlib
import sys
import types

_HOME = {
    "CaptureError": "passes.capture.export", "capture": "passes.capture.export", "Layout": "passes.layout",
    "ShardingError": "passes.layout", "Grid": "passes.mesh", "localize": "passes.transforms.localize",
    "insert_collectives": "passes.transforms.insert_collectives", "propagate": "passes.transforms.propagate",
}
__all__ = list(_HOME)


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _HOME:  # a submodule (passes.options, ...), as when the names above loaded them all
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
            raise AttributeError(f"module 'passes' has no attribute {name!r}")
        value = getattr(importlib.import_module(_HOME[name]), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name, value):
        # importing the subpackage passes.capture binds it on the package; the function of the same
        # name stays `passes.capture`, as it was when these names were imported eagerly
        if name in _HOME and isinstance(value, types.ModuleType):
            value = getattr(importlib.import_module(_HOME[name]), name)
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_HOME))


sys.modules[__name__].__class__ = _Package
