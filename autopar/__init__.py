"""autopar: 2D (Optimus / SUMMA) tensor parallelism for unmodified PyTorch models.

The names below are imported on first use, so that `autopar --help` answers without loading torch.
"""

import importlib
import sys
import types

from autopar import moved

_HOME = {
    "parallelize": "autopar.parallel.api", "ParallelModule": "autopar.parallel.module",
    "FallbackWarning": "autopar.errors", "explain": "autopar.planning.explain", "CaptureError": "autopar.errors",
    "ShardingError": "autopar.errors", "SearchWarning": "autopar.errors", "from_pretrained": "autopar.checkpoint",
    "save_pretrained": "autopar.checkpoint", "CheckpointWarning": "autopar.errors",
    "load_safetensors": "autopar.checkpoint", "meta_init": "autopar.checkpoint",
    "save_distributed": "autopar.checkpoint", "load_distributed": "autopar.checkpoint",
    "plan": "autopar.planning.plan", "Plan": "autopar.planning.plan", "compare_1d": "autopar.planning.plan",
    "choose_grid": "autopar.planning.plan", "CompileWarning": "autopar.errors",
    "max_batch": "autopar.planning.capacity", "AutoparError": "autopar.errors", "AutoparWarning": "autopar.errors",
    "UsageError": "autopar.errors", "CollectiveError": "autopar.errors", "RoutingWarning": "autopar.errors",
    **{name: "autopar.errors" for name in (
        "MemoryLimitError", "UnsupportedError", "SignatureError", "DuplicateRuleError", "TorchVersionError",
        "NotMaterializedError", "NoProcessGroupError", "CheckpointFileError", "CheckpointNotFoundError",
        "CheckpointPermissionError", "MissingWeightsError", "TransformersVersionError", "RankFailedError",
        "MovedWarning", "PlanWarning")},
}
__all__ = list(_HOME)
__version__ = "0.1.0"


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _HOME:  # a submodule (autopar.trainer, ...), as when the names above loaded them all
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
            raise AttributeError(f"module 'autopar' has no attribute {name!r}")
        value = getattr(importlib.import_module(_HOME[name]), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name, value):
        # importing the submodule autopar.plan (or .explain) binds it on the package; the function
        # of the same name stays `autopar.plan`, as it was when these names were imported eagerly
        if name in _HOME and isinstance(value, types.ModuleType):
            value = getattr(importlib.import_module(_HOME[name]), name)
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_HOME))


sys.modules[__name__].__class__ = _Package
moved.install()
