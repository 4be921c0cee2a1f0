"""autopar: 2D (Optimus / SUMMA) tensor parallelism for unmodified PyTorch models."""

from autopar.api import FallbackWarning, ParallelModule, parallelize
from autopar.checkpoint import CheckpointWarning, from_pretrained, load_safetensors, meta_init, save_pretrained
from autopar.distributed_checkpoint import load_distributed, save_distributed
from autopar.explain import explain
from autopar.plan import Plan, choose_grid, compare_1d, plan
from passes import CaptureError, ShardingError
from passes.strategy import SearchWarning

__all__ = ["parallelize", "explain", "ParallelModule", "FallbackWarning", "CaptureError", "ShardingError",
           "SearchWarning", "CheckpointWarning", "from_pretrained", "save_pretrained", "save_distributed",
           "load_distributed", "load_safetensors", "meta_init", "plan", "Plan", "compare_1d", "choose_grid"]
__version__ = "0.1.0"
