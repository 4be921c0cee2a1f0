"""The errors and warnings autopar raises, in one hierarchy: every error derives from
`AutoparError`, every warning from `AutoparWarning` (both exported as `autopar.AutoparError`, ...).
Each error also derives from the builtin it replaced (`UsageError` is a ValueError,
`CheckpointNotFoundError` a FileNotFoundError, ...), so `except ValueError` keeps catching it.

The compiler's own (`UsageError`, `CaptureError`, `ShardingError`, `CollectiveError`,
`MemoryLimitError`, `IndexRangeError`, `UnsupportedError`, `SignatureError`, `DuplicateRuleError`,
`TorchVersionError`, `SearchWarning`, `RoutingWarning`, `FallbackWarning`, `MovedWarning`) are
defined in `passes.errors`, which cannot import this package; they are the same classes here.
"""

from passes.errors import (AutoparError, AutoparWarning, CaptureError, CollectiveError, DuplicateRuleError,
                           FallbackWarning, IndexRangeError, MemoryLimitError, MovedWarning, RoutingWarning,
                           SearchWarning, ShardingError, SignatureError, TorchVersionError, UnsupportedError,
                           UsageError)

__all__ = ["AutoparError", "AutoparWarning", "UsageError", "IndexRangeError", "CaptureError", "ShardingError",
           "CollectiveError", "MemoryLimitError", "UnsupportedError", "SignatureError", "DuplicateRuleError",
           "TorchVersionError",
           "NotMaterializedError", "NoProcessGroupError", "CheckpointFileError", "CheckpointNotFoundError",
           "CheckpointPermissionError", "MissingWeightsError", "TransformersVersionError", "RankFailedError",
           "SearchWarning", "RoutingWarning", "FallbackWarning", "MovedWarning", "CompileWarning",
           "CheckpointWarning", "PlanWarning"]


class NotMaterializedError(AutoparError, RuntimeError):
    """A call of a model parallelized from the meta device before a load filled its parameter blocks."""


class NoProcessGroupError(AutoparError, RuntimeError):
    """parallelize called before torch.distributed.init_process_group."""


class CheckpointFileError(AutoparError, OSError):
    """A checkpoint file or directory could not be read, created or written (a short read, a parent
    that is a file, a full disk)."""


class CheckpointNotFoundError(AutoparError, FileNotFoundError):
    """The path given holds no checkpoint of the kind asked for (no model.safetensors, no DCP
    .metadata, no optimizer state of ParallelTrainer)."""


class CheckpointPermissionError(AutoparError, PermissionError):
    """The process may not write where a checkpoint is saved."""


class MissingWeightsError(AutoparError, KeyError):
    """A checkpoint holds no tensor for some parameters of the model it is loaded into."""


class TransformersVersionError(AutoparError, ImportError):
    """The installed transformers lacks a function autopar reads checkpoint key names with."""


class RankFailedError(AutoparError, RuntimeError):
    """A step failed on one rank with an error of another library (torch, the OS) that autopar has no
    class for; every rank raises this, with that rank's text (`autopar.program.consensus`)."""


class CompileWarning(AutoparWarning):
    """parallelize(..., compile=True): torch.compile failed on a program, which runs eagerly instead."""


class CheckpointWarning(AutoparWarning):
    """A load that skipped checkpoint keys or kept a buffer's computed value."""


class PlanWarning(AutoparWarning):
    """autopar.plan could not measure a figure (the activation memory); the plan's others stand."""
