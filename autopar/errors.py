"""The errors and warnings autopar raises, in one hierarchy: every error derives from
`AutoparError`, every warning from `AutoparWarning` (both exported as `autopar.AutoparError`, ...).

The compiler's own (`CaptureError`, `ShardingError`, `CollectiveError`, `SearchWarning`,
`RoutingWarning`, `FallbackWarning`, `UsageError`) are defined in `passes.errors`, which cannot import this package;
they are the same classes here.
"""

from passes.errors import (AutoparError, AutoparWarning, CaptureError, CollectiveError, FallbackWarning,
                           RoutingWarning, SearchWarning, ShardingError, UsageError)

__all__ = ["AutoparError", "AutoparWarning", "UsageError", "CaptureError", "ShardingError", "CollectiveError",
           "SearchWarning", "RoutingWarning", "FallbackWarning", "CompileWarning", "CheckpointWarning"]


class CompileWarning(AutoparWarning):
    """parallelize(..., compile=True): torch.compile failed on a program, which runs eagerly instead."""


class CheckpointWarning(AutoparWarning):
    """A load that skipped checkpoint keys or kept a buffer's computed value."""
