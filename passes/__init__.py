"""The autopar compiler: capture, layouts, per-op rules, propagation, collective insertion,
localization, and the runtime ops those passes insert. It never imports `autopar`."""

from passes.capture.export import CaptureError, capture
from passes.layout import Layout, ShardingError
from passes.mesh import Grid
from passes.transforms.insert_collectives import insert_collectives
from passes.transforms.localize import localize
from passes.transforms.propagate import propagate

__all__ = ["CaptureError", "Grid", "Layout", "ShardingError", "capture", "insert_collectives", "localize",
           "propagate"]
