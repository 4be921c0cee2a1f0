"""autopar: 2D (Optimus / SUMMA) tensor parallelism for unmodified PyTorch models."""

from autopar.api import FallbackWarning, ParallelModule, parallelize
from autopar.explain import explain
from passes import CaptureError, ShardingError

__all__ = ["parallelize", "explain", "ParallelModule", "FallbackWarning", "CaptureError", "ShardingError"]
__version__ = "0.1.0"
