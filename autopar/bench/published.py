"""`python -m autopar bench --published`: the estimate of published, measured training runs, each
forced to the run's own parallel configuration, next to what was measured.

Every row names its source. Throughput is tokens per second per GPU; memory the GiB the source
reports per GPU (torchtitan: the largest reserved by the caching allocator on any rank). Where a run
used torch.compile, FP8 linears or async TP, the estimate models it (`compile`, `fp8`, `async_tp` of
`autopar.estimate`); each row says which of those it used.

Sources:
- [tt-h100] torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton: 8 H100 96 GB HBM2e
  per host, NVLink, 400 Gb/s RDMA per GPU, 500 W), tables 1, 3, 4 and 5; sequence length 8192.
- [tt-a100] torchtitan, docs/performance.md: Llama 3 8B / 70B and Llama 2 13B / 70B with FSDP2 on
  64 A100 80 GB; sequence length 8192 (Llama 3) and 4096 (Llama 2).
- [tt-async] torchtitan, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (same platform as
  [tt-h100]), the bf16 70B run: FSDP 32 x TP 8, local batch 16, full AC, torch.compile.
- [mlm-h100] Megatron-LM's README ("Training Speed and Scalability", images/model_table.png, Megatron-Core
  r0.8.0, July 2024): GPT models of 1.7B-462B on 48-6,144 H100 GPUs (DGX H100), weak-scaled with 48
  data-parallel replicas, vocabulary 131,072, sequences of 4,096, data-parallel, tensor-parallel and pipeline
  communication overlapped with computation. The table gives teraFLOP/s per GPU; tokens per second here are
  those divided by the FLOPs per token of Megatron's own count at that commit (`megatron_flops_per_token`).
  Not stated by the source, assumed: bf16 with Megatron's distributed optimizer (`shard_optimizer`: the
  fp32 master weights and AdamW states split over the 48 replicas; without it the larger rows do not fit
  80 GB), no activation recomputation, one sequence per micro-batch, the interleaved schedule where the
  layers per stage split evenly (`_megatron_schedule`), TP with sequence parallelism (which its TP overlap
  requires). The source publishes no memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from autopar.planning.architectures import MEGATRON_GPT, MODELS, published_model

__all__ = ["CP_ROWS", "MODELS", "ROWS", "Row", "megatron_flops_per_token", "run_rows", "table"]

@dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: str
    devices: int
    cluster: str
    batch: int  # global, sequences
    seq: int
    config: dict  # estimate() keywords: tp, dp_shard, pp, schedule, interleave, recompute, compile, fp8, async_tp
    tokens_per_s_per_gpu: float  # measured
    memory_gib: float | None = None  # measured, where published
    note: str = ""


# torchtitan (Dec 2024) splits the local batch into as many micro-batches as there are pipeline ranks
# unless told otherwise (experimental.pipeline_parallel_microbatches, default: the pipeline degree)
_PP_NOTE = "8 micro-batches of 4 (torchtitan's default: as many as pipeline ranks)"
_TT8 = dict(dp_shard=8, recompute="selective")
_TT128 = dict(dp_shard=128, recompute="selective")
ROWS = [
    Row("8B FSDP 8", "tt-h100 table 1", "llama3-8b", 8, "grand-teton-h100", 16, 8192, _TT8, 5762, 82.4),
    Row("8B FSDP 8 compile", "tt-h100 table 1", "llama3-8b", 8, "grand-teton-h100", 16, 8192,
        dict(_TT8, compile=True), 6667, 77.0),
    Row("8B FSDP 8 compile FP8", "tt-h100 table 1", "llama3-8b", 8, "grand-teton-h100", 16, 8192,
        dict(_TT8, compile=True, fp8=True), 8532, 76.8),
    Row("8B FSDP 128", "tt-h100 table 3", "llama3-8b", 128, "grand-teton-h100", 256, 8192, _TT128, 5605, 67.0),
    Row("8B FSDP 128 compile", "tt-h100 table 3", "llama3-8b", 128, "grand-teton-h100", 256, 8192,
        dict(_TT128, compile=True), 6514, 62.0),
    Row("8B FSDP 128 compile FP8", "tt-h100 table 3", "llama3-8b", 128, "grand-teton-h100", 256, 8192,
        dict(_TT128, compile=True, fp8=True), 8380, 61.8),
    Row("70B FSDP 32 x TP 8 compile FP8", "tt-h100 table 4", "llama3-70b", 256, "grand-teton-h100", 512, 8192,
        dict(tp=8, dp_shard=32, recompute="full", compile=True, fp8=True), 829, 71.9),
    Row("70B FSDP 32 x TP 8 compile FP8 async TP", "tt-h100 table 4", "llama3-70b", 256, "grand-teton-h100", 512,
        8192, dict(tp=8, dp_shard=32, recompute="full", compile=True, fp8=True, async_tp=True), 876, 67.6),
    Row("70B FSDP 32 x TP 8 compile bf16", "tt-async", "llama3-70b", 256, "grand-teton-h100", 512, 8192,
        dict(tp=8, dp_shard=32, recompute="full", compile=True), 597, None,
        "read off the page's figure (as quoted in issue 52); vanilla TP assumed"),
    Row("405B FSDP 8 x TP 8 x PP 8 1F1B", "tt-h100 table 5", "llama3-405b", 512, "grand-teton-h100", 256, 8192,
        dict(tp=8, dp_shard=8, pp=8, schedule="1f1b", microbatches=8, recompute="full", compile=True, fp8=True,
             async_tp=True), 100, 82.5, _PP_NOTE),
    Row("405B FSDP 8 x TP 8 x PP 8 interleaved", "tt-h100 table 5", "llama3-405b", 512, "grand-teton-h100", 256,
        8192, dict(tp=8, dp_shard=8, pp=8, schedule="interleaved_1f1b", interleave=2, microbatches=8,
                   recompute="full", compile=True, fp8=True, async_tp=True), 128, 72.7,
        _PP_NOTE + "; 2 stages per rank assumed (the source does not say)"),
    Row("A100 8B FSDP 64", "tt-a100 (Llama 3)", "llama3-8b", 64, "dgx-a100", 64, 8192,
        dict(dp_shard=64, recompute="selective"), 2973),
    Row("A100 70B FSDP 64", "tt-a100 (Llama 3)", "llama3-70b", 64, "dgx-a100", 64, 8192,
        dict(dp_shard=64, recompute="full"), 331),
    Row("A100 Llama 2 13B FSDP 64, no AC", "tt-a100 (Llama 2)", "llama2-13b", 64, "dgx-a100", 128, 4096,
        dict(dp_shard=64, recompute="none"), 2162),
    Row("A100 Llama 2 13B FSDP 64", "tt-a100 (Llama 2)", "llama2-13b", 64, "dgx-a100", 128, 4096,
        dict(dp_shard=64, recompute="selective"), 1904),
    Row("A100 Llama 2 70B FSDP 64", "tt-a100 (Llama 2)", "llama2-70b", 64, "dgx-a100", 128, 4096,
        dict(dp_shard=64, recompute="full"), 353),
]


def megatron_flops_per_token(model: str, seq: int) -> float:
    """The FLOPs Megatron-LM counts per token of a training step for its GPT models (forward and backward,
    no recomputation; megatron/training/training.py's num_floating_point_operations at the commit of the
    H100 table): 12 l h^2 (2 + s/h + 4 + V / (2 l h)) for full multi-head attention and a 4h MLP."""
    _, h, layers = MEGATRON_GPT[model]
    vocab = MODELS[model]["vocab_size"]
    return 12 * layers * h * h * (2 + seq / h + 4 + vocab / (2 * layers * h))


def _megatron_schedule(model: str, pp: int) -> dict:
    """Pipeline keywords for a Megatron run of `pp` stages: the interleaved schedule with the most virtual
    stages up to 4 that the layers per stage divide into (Megatron's --num-layers-per-virtual-pipeline-stage
    must divide them); 1F1B where none does."""
    if pp == 1:
        return {}
    per_stage = MEGATRON_GPT[model][2] // pp
    v = max(k for k in (1, 2, 3, 4) if per_stage % k == 0)
    return dict(pp=pp, schedule="interleaved_1f1b", interleave=v) if v > 1 else dict(pp=pp, schedule="1f1b")


# (model, tensor-parallel, pipeline, GPUs, global batch, teraFLOP/s per GPU): the rows of [mlm-h100]
_MLM_H100 = [("megatron-gpt-1.7b", 1, 1, 48, 192, 408.8), ("megatron-gpt-7.1b", 2, 1, 96, 192, 465.9),
             ("megatron-gpt-16b", 4, 1, 192, 192, 489.1), ("megatron-gpt-32b", 8, 1, 384, 192, 459.6),
             ("megatron-gpt-70b", 8, 2, 768, 384, 419.7), ("megatron-gpt-119b", 8, 4, 1536, 768, 420.5),
             ("megatron-gpt-177b", 8, 6, 2304, 1152, 432.8), ("megatron-gpt-314b", 8, 8, 3072, 1536, 474.4),
             ("megatron-gpt-462b", 8, 16, 6144, 3072, 459.9)]
ROWS += [
    Row(f"Megatron GPT {m.rsplit('-', 1)[1].upper()} TP {tp} x PP {pp} x DP 48", "mlm-h100", m, gpus, "dgx-h100",
        batch, 4096, dict(tp=tp, dp_shard=1, dp_replicate=48, shard_optimizer=True, recompute="none",
                          async_tp=tp > 1, **_megatron_schedule(m, pp)),
        tflops * 1e12 / megatron_flops_per_token(m, 4096), None, f"{tflops} teraFLOP/s per GPU measured")
    for m, tp, pp, gpus, batch, tflops in _MLM_H100]

# torchtitan's context-parallel runs (tt-h100 tables 2 and 6: FSDP x CP, compile, Float8, full recomputation, local
# batch 1 and 8; priced with K and V all-gathered per attention): kept apart from ROWS, which the bounds and
# the search's checks read; `autopar.estimate(cp=)` prices them (docs/benchmarks.md, Context parallelism)
CP_ROWS = [
    Row(f"8B FSDP {8 // cp} x CP {cp}", "tt-h100 table 2", "llama3-8b", 8, "grand-teton-h100", 8 // cp, 32768 * cp,
        dict(dp_shard=8 // cp, cp=cp, cp_attention="allgather", recompute="full", compile=True, fp8=True), tps, gib)
    for cp, tps, gib in [(1, 3890, 83.9), (2, 2540, 84.2), (4, 1071, 84.0), (8, 548, 84.5)]
] + [
    Row(f"405B FSDP {8 // cp} x CP {cp} x TP 8 x PP 8", "tt-h100 table 6", "llama3-405b", 512, "grand-teton-h100",
        8 * (8 // cp), 32768 * cp, dict(tp=8, pp=8, dp_shard=8 // cp, cp=cp, cp_attention="allgather", microbatches=8,
                                         recompute="full", compile=True, fp8=True, async_tp=True), tps, gib, _PP_NOTE)
    for cp, tps, gib in [(1, 76, 75.3), (2, 47, 75.9), (4, 31, 77.1), (8, 16, 84.9)]
]


@dataclass
class Result:
    row: Row
    estimate: object  # autopar.planning.estimate.Estimate
    extra: dict = field(default_factory=dict)

    @property
    def speed_ratio(self) -> float:
        return self.estimate.tokens_per_s_per_gpu / self.row.tokens_per_s_per_gpu

    @property
    def memory_ratio(self) -> float | None:
        m = self.row.memory_gib
        return self.estimate.memory_gib_per_rank / m if m else None

    def to_json(self) -> dict:
        r = self.row
        return {"name": r.name, "source": r.source, "model": r.model, "devices": r.devices, "cluster": r.cluster,
                "batch": r.batch, "seq": r.seq, "config": r.config, "measured_tokens_per_s_per_gpu":
                r.tokens_per_s_per_gpu, "measured_memory_gib": r.memory_gib, "note": r.note,
                "estimated_tokens_per_s_per_gpu": self.estimate.tokens_per_s_per_gpu,
                "estimated_memory_gib": self.estimate.memory_gib_per_rank, "speed_ratio": self.speed_ratio,
                "memory_ratio": self.memory_ratio, "estimate": self.estimate.to_json(), **self.extra}


def run_rows(rows=ROWS, progress: bool = True) -> list:
    from autopar.planning.estimate import estimate
    from autopar.planning.progress import steps

    cache: dict = {}
    out = []
    with steps("autopar bench --published", len(rows), progress) as bar:
        for r in rows:
            bar.set_postfix_str(r.name)
            est = estimate(published_model(r.model, cache), devices=r.devices, cluster=r.cluster, global_batch=r.batch,
                           seq=r.seq, **r.config)
            out.append(Result(r, est))
            bar.update()
    return out


def table(results: list) -> str:
    lines = ["| run | source | measured tok/s/GPU | estimated | ratio | measured GiB | estimated | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        r, e = res.row, res.estimate
        mem = f"{r.memory_gib:.1f}" if r.memory_gib else "-"
        mr = f"{res.memory_ratio:.2f}" if res.memory_ratio else "-"
        lines.append(f"| {r.name} | {r.source} | {r.tokens_per_s_per_gpu:,.0f} | {e.tokens_per_s_per_gpu:,.0f} | "
                     f"{res.speed_ratio:.2f} | {mem} | {e.memory_gib_per_rank:.1f} | {mr} |")
    return "\n".join(lines)


def plot(results: list, path: str) -> None:
    """Estimate / measured against the measured throughput, one colour per source, the 0.8-1.25 band
    shaded: no point labels to overlap (the table names each row)."""
    from autopar.planning.report import require_matplotlib

    plt = require_matplotlib("autopar bench --published --plot")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [r.row.tokens_per_s_per_gpu for r in results]
    lo, hi = min(xs) / 1.5, max(xs) * 1.5
    ax.fill_between([lo, hi], [0.8, 0.8], [1.25, 1.25], color="0.92", label="0.8-1.25x")
    ax.axhline(1.0, color="k", lw=0.8)
    groups = {"torchtitan H100": "tt-h100", "torchtitan async TP": "tt-async", "torchtitan A100": "tt-a100",
              "Megatron-LM H100": "mlm-h100"}
    for (label, prefix), marker in zip(groups.items(), "osD^"):
        pts = [(r.row.tokens_per_s_per_gpu, r.speed_ratio) for r in results if r.row.source.startswith(prefix)]
        if pts:
            ax.semilogx(*zip(*pts), marker, label=f"{label} ({len(pts)})", alpha=0.85)
    ax.set_xlim(lo, hi)
    ax.set_ylim(0.6, 1.4)
    ax.set_xlabel("measured tokens/s/GPU (published)")
    ax.set_ylabel("autopar.estimate / measured")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(ns) -> int:
    results = run_rows(progress=not ns.json)
    data = [r.to_json() for r in results]
    out = getattr(ns, "out", None)
    if out:
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
    if getattr(ns, "plot", None):
        plot(results, ns.plot if isinstance(ns.plot, str) else os.path.join("docs", "published.png"))
    print(json.dumps(data, indent=1) if ns.json else table(results))
    return 0
