"""strategy="auto": the search over 2D / 1D / replicated per weight matmul (`strategy`), priced by the
estimate of a propagated graph (`estimate`), what recomputing blocks saves (`recompute_cost`) and what
data-parallel replicas add (`replica_cost`)."""
