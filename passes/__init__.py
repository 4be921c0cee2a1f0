"""The autopar compiler: capture, layouts, per-op rules, propagation, collective insertion,
localization, and the runtime ops those passes insert. It never imports `autopar`.

The names below are imported on first use, so that a module that needs no torch (`passes.options`,
whose declarations the command line builds its flags from) imports without loading it.
"""

from passes.lazy import lazy_names

_HOME = {
    "CaptureError": "passes.capture.export", "capture": "passes.capture.export", "Layout": "passes.layout",
    "ShardingError": "passes.layout", "Grid": "passes.mesh", "localize": "passes.transforms.localize",
    "insert_collectives": "passes.transforms.insert_collectives", "propagate": "passes.transforms.propagate",
}
__all__ = list(_HOME)


lazy_names(__name__, _HOME)
