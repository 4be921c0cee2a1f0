"""The alpha-beta model that prices a plan: seconds per collective launch and bytes received per
second on each mesh axis, and the matmul rate. `autopar calibrate` measures one; its JSON (or the
published GPU-cluster defaults) becomes a `CostModel` here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    """alpha (s per collective) and beta (bytes received per s) per mesh axis, and the matmul rate
    (see `autopar.planning.calibrate` for measured values and the published defaults)."""

    alpha: tuple
    beta: tuple
    flops: float
    source: str = "?"

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """From the JSON `autopar calibrate` writes (see autopar/planning/calibrate.py)."""
        axes = d["axes"]
        beta = tuple(float("inf") if a["beta_bytes_per_s"] is None else float(a["beta_bytes_per_s"]) for a in axes)
        return cls(tuple(float(a["alpha_s"]) for a in axes), beta, float(d["flops_per_s"]), d.get("source", "?"))

    def collective(self, axis: int, nbytes: float, calls: int = 1) -> float:
        return calls * self.alpha[axis] + nbytes / self.beta[axis]
