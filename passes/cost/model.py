"""The alpha-beta model that prices a plan: seconds per collective launch and bytes received per
second on each mesh axis, and the matmul rate. `autopar calibrate` measures one; its JSON (or the
published GPU-cluster defaults) becomes a `CostModel` here."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from passes.errors import UsageError

VERSION = 1
KEYS = ("version", "source", "grid", "backend", "device", "axes", "flops_per_s", "when")
# measured since, read where present (autopar.estimate's roofline: `passes.cost.cluster.from_calibration`)
OPTIONAL_KEYS = ("memory_bytes_per_s", "op_s", "in_step_alpha_s", "matmul", "hidden")
AXIS_KEYS = ("alpha_s", "beta_bytes_per_s", "points")
RERUN = "re-run `autopar calibrate --grid RxC` to write a fresh one"

DEFAULT = {
    "version": VERSION,
    "source": "default: published NVLink/InfiniBand figures",
    "grid": [8, 8],  # 64 GPUs in 8 nodes of 8: axis 1 (consecutive ranks) inside a node, axis 0 across nodes
    "backend": "nccl",
    "device": "cuda",
    "axes": [
        # axis 0 crosses nodes: one 200 Gb/s InfiniBand HDR HCA per GPU = 25 GB/s; ~20 us per collective
        {"alpha_s": 2e-5, "beta_bytes_per_s": 25e9, "points": []},
        # axis 1 inside a node: NVLink 4 is 900 GB/s bidirectional per H100 (NVIDIA); ~150 GB/s is a
        # conservative achieved per-rank bus bandwidth for ring collectives; ~10 us per collective
        {"alpha_s": 1e-5, "beta_bytes_per_s": 150e9, "points": []},
    ],
    "flops_per_s": 400e12,  # a realistic bf16 fraction of the H100 SXM's 989 TFLOP/s dense (NVIDIA datasheet)
    "when": "2026-11-30T00:00:00+00:00",  # when these figures were written down, not measured
}




@dataclass
class CostModel:
    """alpha (s per collective) and beta (bytes received per s) per mesh axis, and the matmul rate
    (see `autopar.planning.calibrate` for measured values and the published defaults)."""

    alpha: tuple
    beta: tuple
    flops: float
    source: str = "?"
    # of a transfer that runs beside a matmul, the share the matmul hides: 1 where the transfer has hardware of
    # its own (copy engines and NICs beside the SMs), 0 where both run on the same cores. `autopar calibrate`
    # measures it (`hidden` in its JSON); the published defaults take 1.
    hidden: float = 1.0

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """From the JSON `autopar calibrate` writes (see autopar/planning/calibrate.py)."""
        axes = d["axes"]
        beta = tuple(float("inf") if a["beta_bytes_per_s"] is None else float(a["beta_bytes_per_s"]) for a in axes)
        return cls(tuple(float(a["alpha_s"]) for a in axes), beta, float(d["flops_per_s"]), d.get("source", "?"),
                   float(d.get("hidden", 1.0)))

    def collective(self, axis: int, nbytes: float, calls: int = 1) -> float:
        return calls * self.alpha[axis] + nbytes / self.beta[axis]

    @classmethod
    def resolve(cls, spec) -> "CostModel":
        """None (published GPU-cluster figures, `DEFAULT`), a CostModel, a dict or a path of the JSON
        `autopar calibrate` writes."""
        if spec is None or isinstance(spec, cls):
            return spec or cls.from_dict(DEFAULT)
        return cls.from_dict(validate(spec) if isinstance(spec, dict) else load(spec))


def unit_axis() -> dict:
    """The model of an axis of size 1: it never communicates."""
    return {"alpha_s": 0.0, "beta_bytes_per_s": math.inf, "points": []}


def summary(model: dict) -> str:
    """A few human lines: per axis alpha in microseconds and beta in GB/s, and the matmul rate."""
    head = (f"autopar calibration ({model['source']}): grid {model['grid'][0]}x{model['grid'][1]}, "
            f"backend {model['backend']}, device {model['device']}, {model['when']}")
    lines = [head]
    for axis, ax in enumerate(model["axes"]):
        beta = ax["beta_bytes_per_s"]
        if beta is None or math.isinf(beta):
            lines.append(f"  mesh axis {axis}: size 1, no communication")
        else:
            lines.append(f"  mesh axis {axis}: alpha {ax['alpha_s'] * 1e6:.1f} us, beta {beta / 1e9:.3f} GB/s "
                         f"({len(ax['points'])} points)")
    mm = model.get("matmul") or {}
    what = f" ({mm['dtype']}, {len(mm['shapes'])} shape(s){', TF32 allowed' if mm.get('tf32') else ''})" if mm else ""
    lines.append(f"  matmul: {model['flops_per_s'] / 1e9:.1f} GFLOP/s{what}")
    if "hidden" in model:
        lines.append(f"  a transfer beside a matmul: {model['hidden']:.0%} of it hidden (overlap='auto' "
                     f"{'overlaps' if model['hidden'] > 0 else 'runs every transfer in line'})")
    for row in mm.get("shapes", []) if len(mm.get("shapes", [])) > 1 else []:
        lines.append(f"    {row['m']}x{row['k']}x{row['n']}: {row['flops_per_s'] / 1e9:.1f} GFLOP/s")
    if mm.get("peak_fraction") is not None:
        lines.append(f"  {mm['peak_fraction']:.2%} of the preset's dense peak ({mm['peak_flops'] / 1e12:.1f} TFLOP/s)")
    return "\n".join(lines)


def save(model: dict, path) -> None:
    """Write `model` as JSON to `path` (beta inf -> null); written to a temporary file first, so a
    reader never sees half a file."""
    out = dict(model)
    out["axes"] = [dict(ax, beta_bytes_per_s=_json_beta(ax["beta_bytes_per_s"])) for ax in model["axes"]]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _json_beta(beta):
    """inf (an axis that never communicates) as null: JSON has no infinity."""
    return None if beta is None or math.isinf(beta) else float(beta)


def load(path) -> dict:
    """Read a calibration written by `save`, check its version and keys, and return it with beta
    null read back as inf. Raises UsageError naming what is wrong."""
    try:
        with open(path) as f:
            model = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not a JSON calibration file ({e}); {RERUN}") from None
    return validate(model, where=str(path))


def validate(model, where: str = "calibration") -> dict:
    """`model` checked against the schema (version 1), with beta null as inf; UsageError otherwise."""
    if not isinstance(model, dict):
        # UsageError (a ValueError), not TypeError: a damaged file is one kind of error for the caller to catch
        raise UsageError(f"{where}: expected a JSON object, got {type(model).__name__}; {RERUN}")  # noqa: TRY004
    if model.get("version") != VERSION:
        raise UsageError(f"{where}: calibration version {model.get('version')!r}, this autopar reads version "
                         f"{VERSION}; {RERUN}")
    missing = [k for k in KEYS if k not in model]
    if missing:
        raise UsageError(f"{where}: missing key(s) {missing} (expected {list(KEYS)}); {RERUN}")
    grid, axes = model["grid"], model["axes"]
    if not (isinstance(grid, list) and len(grid) == 2 and all(isinstance(g, int) and g >= 1 for g in grid)):
        raise UsageError(f"{where}: 'grid' must be [R, C] with positive ints, got {grid!r}; {RERUN}")
    if not (isinstance(axes, list) and len(axes) == 2):
        raise UsageError(f"{where}: 'axes' must list one entry per mesh axis (2), got {axes!r}; {RERUN}")
    out_axes = []
    for axis, ax in enumerate(axes):
        bad = [k for k in AXIS_KEYS if not isinstance(ax, dict) or k not in ax]
        if bad:
            raise UsageError(f"{where}: axes[{axis}] lacks {bad} (expected {list(AXIS_KEYS)}); {RERUN}")
        beta = math.inf if ax["beta_bytes_per_s"] is None else float(ax["beta_bytes_per_s"])
        if float(ax["alpha_s"]) < 0 or beta <= 0:
            raise UsageError(f"{where}: axes[{axis}] needs alpha_s >= 0 and beta_bytes_per_s > 0 (or null), got "
                             f"{ax['alpha_s']!r}, {ax['beta_bytes_per_s']!r}; {RERUN}")
        out_axes.append(dict(ax, alpha_s=float(ax["alpha_s"]), beta_bytes_per_s=beta))
    if not float(model["flops_per_s"]) > 0:
        raise UsageError(f"{where}: 'flops_per_s' must be > 0, got {model['flops_per_s']!r}; {RERUN}")
    hidden = model.get("hidden", 1.0)
    if not (isinstance(hidden, (int, float)) and not isinstance(hidden, bool) and 0 <= hidden <= 1):
        raise UsageError(f"{where}: 'hidden' (the share of a transfer a concurrent matmul hides) must be a number "
                         f"in [0, 1], got {hidden!r}; {RERUN}")
    return dict(model, axes=out_axes, flops_per_s=float(model["flops_per_s"]))
