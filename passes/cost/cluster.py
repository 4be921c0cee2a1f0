"""A cluster of GPU nodes as the cost model sees it: GPUs per node, the link inside a node and the link
between nodes (alpha: seconds per collective or send; beta: bytes received per second per GPU), the
matmul rate and the memory per GPU. A mesh axis whose group spans more than one node is priced with
the link between nodes, one inside a node with NVLink.

Global rank = ((pipeline rank * d) + replica) * R * C + r * C + c (`passes.mesh.Grid`), so with nodes
of G GPUs holding consecutive ranks: the grid's column axis spans C ranks, its row axis R*C, the
replica axis d*R*C, the pipeline axis S*d*R*C. An axis is inside a node when its span is at most G.

The presets' figures are the vendors' published line rates (NVLink: per GPU, one direction, half the
bidirectional figure NVIDIA quotes; InfiniBand / RDMA: one NIC per GPU) and a realistic share of the
dense bf16 matmul peak; achieved collective bandwidth is lower, so these are optimistic, and an
`autopar calibrate` run on the real cluster replaces them.

- 'dgx-h100': 8 H100 SXM per node, NVLink 4 at 900 GB/s bidirectional (NVIDIA H100 datasheet),
  8 ConnectX-7 NDR InfiniBand NICs at 400 Gb/s = 50 GB/s per GPU (NVIDIA DGX H100 datasheet);
  989 TFLOP/s dense bf16 peak, 400 TFLOP/s assumed reached; 80 GB HBM3.
- 'grand-teton-h100': torchtitan's benchmark platform (torchtitan benchmarks/llama3_h100_202412):
  8 H100 per host, NVLink, 400 Gb/s RDMA per GPU, 96 GB HBM2e, 500 W power limit (so a lower reached
  rate, 350 TFLOP/s assumed).
- 'dgx-a100': 8 A100 SXM 80GB, NVLink 3 at 600 GB/s bidirectional (NVIDIA A100 datasheet), 8 HDR
  InfiniBand NICs at 200 Gb/s = 25 GB/s per GPU (DGX A100 datasheet); 312 TFLOP/s dense bf16 peak,
  150 TFLOP/s assumed reached.

The roofline of `autopar.estimate` (`passes.cost.step`) reads the fields after `memory_bytes`:
`peak_flops` (dense bf16: 989.4 T for H100 SXM, 312 T for A100, NVIDIA datasheets) and the share of it
a large GEMM reaches (`matmul_efficiency`: 0.72 on a 700 W DGX H100, 0.55 on Grand Teton's 500 W cap,
0.80 on A100); flash attention's share (`attention_efficiency`: FlashAttention-2, Dao 2023, reports
50-73% of A100's peak forward and about a third of H100's; 0.55 / 0.33 / 0.25 taken for forward and
backward together); HBM bandwidth (`hbm_bytes_per_s`: 3.35 TB/s HBM3, 2.4 TB/s HBM2e on Grand Teton as
torchtitan's benchmark page gives it, 2.039 TB/s A100 80GB) and the share an eager elementwise kernel
reaches (`hbm_efficiency` 0.8); the share of a link's line rate an NCCL ring reaches
(`collective_efficiency` 0.85). Assumptions, not measurements: `fp8_speedup` 1.6 (an FP8 linear over
its bf16 one, casts included), `overlap_cost` 0.2 (compute lost per second of hidden communication),
`runtime_bytes` 2.5 GiB (CUDA context, NCCL and cuBLAS workspaces) and `reserve_factor` 1.07 (the
caching allocator's overhead). `autopar calibrate`'s JSON replaces them for the machines it measured
(`from_calibration`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from passes.cost.model import CostModel
from passes.errors import UsageError

__all__ = ["Cluster", "Link", "PRESETS", "from_calibration", "resolve_cluster"]


@dataclass(frozen=True)
class Link:
    alpha_s: float  # per collective launch or point-to-point send
    beta_bytes_per_s: float  # received per GPU


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra: Link  # inside a node
    inter: Link  # between nodes
    flops_per_s: float
    memory_bytes: float  # per GPU
    # the roofline `passes.cost.step` prices a step with (see the presets' docstring for the sources)
    peak_flops: float = 989.4e12  # dense bf16 tensor-core peak per GPU
    matmul_efficiency: float = 0.65  # share of peak a large bf16 GEMM reaches
    attention_efficiency: float = 0.35  # share of peak a flash attention kernel reaches, forward and backward
    hbm_bytes_per_s: float = 3.35e12  # memory bandwidth per GPU
    hbm_efficiency: float = 0.8  # share of it an eager elementwise kernel reaches
    fp8_speedup: float = 1.6  # a linear's FP8 GEMM over its bf16 one, casts included
    runtime_bytes: float = 2.5 * 2**30  # per GPU outside the tensors: CUDA context, NCCL and cuBLAS workspaces
    collective_efficiency: float = 0.85  # share of a link's line rate an NCCL ring collective reaches
    overlap_cost: float = 0.2  # seconds of compute lost per second of communication hidden behind it (SMs and
    # memory bandwidth the collective's kernels take)
    reserve_factor: float = 1.07  # the caching allocator's reserved bytes over the tensors' (fragmentation)
    op_s: float = 0.0  # per op of the graph, forward and backward: the floor an eager CPU step pays per op (on
    # GPUs launches are asynchronous and overlap the kernels before them: 0)
    alpha_by_size: tuple = ()  # ((group size, seconds per collective inside a step), ...) where measured

    def link(self, span: int) -> Link:
        """The link an axis whose group spans `span` consecutive ranks uses."""
        return self.intra if span <= self.gpus_per_node else self.inter

    def group_link(self, span: int, size: int) -> Link:
        """The link a collective over `size` members spread evenly over `span` consecutive ranks uses,
        per member: inside a node NVLink; across nodes each node's members drive a NIC each, and NCCL's
        rings spread the traffic over all of them (one channel per NIC), so the bandwidth per member is
        the node's members times one NIC, at most NVLink's."""
        if self.alpha_by_size:  # measured per group size (a calibration): the nearest size at or above
            alpha = next((a for g, a in self.alpha_by_size if g >= size), self.alpha_by_size[-1][1])
            base = self.intra if span <= self.gpus_per_node else self.inter
            return Link(alpha, base.beta_bytes_per_s)
        if span <= self.gpus_per_node:
            return self.intra
        per_node = max(1, size * self.gpus_per_node // span)
        return Link(self.inter.alpha_s, min(self.intra.beta_bytes_per_s, per_node * self.inter.beta_bytes_per_s))

    def spans(self, stages: int, dp: int, rows: int, cols: int) -> dict:
        """Consecutive ranks each axis's group spans (see the module docstring)."""
        tp = rows * cols
        return {"col": cols, "row": tp, "dp": dp * tp, "pp": stages * dp * tp}

    def cost_model(self, stages: int, dp: int, rows: int, cols: int) -> CostModel:
        """The grid's CostModel (axis 0 rows, axis 1 columns) for this placement of the ranks."""
        s = self.spans(stages, dp, rows, cols)
        row, col = self.link(s["row"]), self.link(s["col"])
        return CostModel((row.alpha_s, col.alpha_s), (row.beta_bytes_per_s, col.beta_bytes_per_s), self.flops_per_s,
                         f"cluster {self.name} ({self.gpus_per_node} GPUs per node)")

    def axis_link(self, axis: str, stages: int, dp: int, rows: int, cols: int) -> Link:
        """The link of axis 'col', 'row', 'dp' or 'pp' for this placement."""
        return self.link(self.spans(stages, dp, rows, cols)[axis])


_NVLINK4, _NVLINK3 = Link(1e-5, 450e9), Link(1e-5, 300e9)
PRESETS = {
    "dgx-h100": Cluster("dgx-h100", 8, _NVLINK4, Link(2e-5, 50e9), 400e12, 80 * 2**30,
                        matmul_efficiency=0.72, attention_efficiency=0.33, hbm_bytes_per_s=3.35e12),
    "grand-teton-h100": Cluster("grand-teton-h100", 8, _NVLINK4, Link(2e-5, 50e9), 350e12, 95 * 2**30,
                                matmul_efficiency=0.55, attention_efficiency=0.25, hbm_bytes_per_s=2.4e12),
    "dgx-a100": Cluster("dgx-a100", 8, _NVLINK3, Link(2e-5, 25e9), 150e12, 80 * 2**30, peak_flops=312e12,
                        matmul_efficiency=0.80, attention_efficiency=0.55, hbm_bytes_per_s=2.039e12,
                        fp8_speedup=1.0),
}


def from_calibration(model: dict, name: str = "calibrated") -> Cluster:
    """The machines `autopar calibrate` measured (its JSON as a dict) as one node: every rank on it, the
    slower axis's alpha and beta for its link, the measured matmul rate as the peak (reached: efficiency
    1), the measured elementwise bandwidth and per-op floor, and a collective's cost inside a step per
    group size where measured; of a transfer beside a matmul, the share the calibration measured hidden
    (`hidden`: overlap_cost 1 - hidden), else none (overlap_cost 1: communication competes with compute
    for the same cores)."""
    finite = [a for a in model["axes"] if a["beta_bytes_per_s"] and math.isfinite(a["beta_bytes_per_s"])]
    link = Link(max((a["alpha_s"] for a in finite), default=0.0),
                min((a["beta_bytes_per_s"] for a in finite), default=math.inf))
    ranks = model["grid"][0] * model["grid"][1]
    return Cluster(name, ranks, link, link, model["flops_per_s"], math.inf, peak_flops=model["flops_per_s"],
                   matmul_efficiency=1.0, attention_efficiency=1.0,
                   hbm_bytes_per_s=model.get("memory_bytes_per_s", 1e10), hbm_efficiency=1.0, fp8_speedup=1.0,
                   runtime_bytes=0.0, reserve_factor=1.0, collective_efficiency=1.0,
                   overlap_cost=1.0 - float(model.get("hidden", 0.0)),
                   op_s=model.get("op_s", 0.0),
                   alpha_by_size=tuple(sorted((int(g), float(a)) for g, a in model.get("in_step_alpha_s", {}).items())))


def resolve_cluster(spec) -> Cluster | None:
    """None, a Cluster, a preset's name (see `PRESETS`) or the path of an `autopar calibrate` JSON."""
    if spec is None or isinstance(spec, Cluster):
        return spec
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    if isinstance(spec, str) and spec.endswith(".json") and os.path.isfile(spec):
        from passes.cost.model import load

        return from_calibration(load(spec), os.path.basename(spec))
    raise UsageError(f"cluster={spec!r}: expected a Cluster, one of the presets {sorted(PRESETS)} or the path of "
                     f"an `autopar calibrate` JSON")
