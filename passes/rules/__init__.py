"""Per-op sharding rules: one pure function per op family, registered on aten overloads.

The registry and the `Strategy` a rule returns are in `passes.rules.registry`; importing this package
imports every family, which registers their rules. `lookup(target)` finds the rule of an op.
"""

from passes.rules import (attention, conv_inplace, einsum, embedding_loss, fallback, indexing,  # noqa: F401
                          matmul, norms, pointwise, views)
from passes.rules.moe import experts, histogram, routing  # noqa: F401
from passes.rules.registry import Strategy, Unsupported, lookup

__all__ = ["Strategy", "Unsupported", "lookup"]
