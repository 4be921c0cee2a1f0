"""autopar: 2D (Optimus / SUMMA) tensor parallelism for unmodified PyTorch models.

The names below are imported on first use, so that `autopar --help` answers without loading torch.
"""

from autopar import moved
from passes.lazy import lazy_names

_HOME = {
    "parallelize": "autopar.parallel.api", "ParallelModule": "autopar.parallel.module",
    "Pipeline": "autopar.program.pipe", "PipelineModule": "autopar.parallel.pipeline",
    "FallbackWarning": "autopar.errors", "explain": "autopar.planning.explain", "CaptureError": "autopar.errors",
    "ShardingError": "autopar.errors", "SearchWarning": "autopar.errors", "from_pretrained": "autopar.checkpoint",
    "save_pretrained": "autopar.checkpoint", "CheckpointWarning": "autopar.errors",
    "load_safetensors": "autopar.checkpoint", "meta_init": "autopar.checkpoint",
    "load_full_state_dict": "autopar.checkpoint",
    "save_distributed": "autopar.checkpoint", "load_distributed": "autopar.checkpoint",
    "plan": "autopar.planning.plan", "Plan": "autopar.planning.plan", "compare_1d": "autopar.planning.plan",
    "choose_grid": "autopar.planning.plan", "choose_pipeline": "autopar.planning.pipeline_plan",
    "CompileWarning": "autopar.errors",
    "count_host_syncs": "autopar.program.syncs", "flush_checks": "autopar.program.syncs",
    "audit_devices": "autopar.program.audit",
    "verify": "autopar.debug.verify", "VerifyReport": "autopar.debug.verify", "report": "autopar.debug.report",
    "StepReport": "autopar.debug.report",
    "dry_run": "autopar.parallel.dry_run", "DryRunError": "autopar.parallel.dry_run",
    "estimate": "autopar.planning.estimate", "choose_plan": "autopar.planning.search",
    "max_batch": "autopar.planning.capacity", "AutoparError": "autopar.errors", "AutoparWarning": "autopar.errors",
    "UsageError": "autopar.errors", "CollectiveError": "autopar.errors", "RoutingWarning": "autopar.errors",
    **{name: "autopar.errors" for name in (
        "MemoryLimitError", "UnsupportedError", "SignatureError", "DuplicateRuleError", "TorchVersionError",
        "NotMaterializedError", "NoProcessGroupError", "CheckpointFileError", "CheckpointNotFoundError",
        "CheckpointPermissionError", "MissingWeightsError", "TransformersVersionError", "RankFailedError",
        "MovedWarning", "PlanWarning", "IndexRangeError")},
}
__all__ = list(_HOME)
__version__ = "0.1.0"


lazy_names(__name__, _HOME, first_use="autopar.checkpoint")  # it registers pmodel.save_pretrained
moved.install()
