"""A training step's time and memory per GPU, priced by a roofline from a model's profile.

Inputs: the model's `Profile` (per sequence, unsplit: `passes.cost.profile`), its depth, what its
tensor-parallel layout moves per block and outside the blocks (`TPBytes`, from the plan's own byte
counts), the parallel configuration (`Parallel`) and the hardware (`passes.cost.cluster.Cluster`).

Time, per GPU and step:

- compute: every matmul at `matmul_efficiency` of the peak (x `fp8_speedup` for the linears with FP8),
  attention at `attention_efficiency`, memory-bound ops at `hbm_efficiency` of the HBM bandwidth;
  backward twice the forward (2.5 times for attention); full recomputation one forward more,
  per-op selective recomputation the skipped matmuls and the memory-bound ops once more;
  `compile` fuses chains of memory-bound ops (`FUSED`: the share of their traffic left);
- tensor parallelism: the plan's bytes over the link its group spans, at `collective_efficiency` of
  the line rate, plus a launch latency per call; exposed for 1D (hidden behind the matmuls with
  `async_tp`: each collective behind the run of matmuls beside it, as torch's fused all-gather-matmul
  and matmul-reduce-scatter overlap them), overlapped with the matmuls for 2D and 3D (the broadcast
  lowering), all but the first of a product's max(R, C) panels (none with `overlap` False);
- sharded replicas (FSDP2): each stage's parameters all-gathered in bf16 (again for backward when
  resharded after forward: without pipeline stages, unless `reshard_after_forward` is False) and
  gradients reduce-scattered (fp32 under 'bf16-mixed'), once per step inside a pipeline (gathered at
  the first micro-batch, reduced after the last); replicated ones all-reduce gradients. Hidden behind
  compute except the first gather and the last reduction (a block's: FSDP2's unit, DDP's or Megatron's
  last bucket); the rest only where compute is shorter;
- pipeline: the schedule's bubble (`passes.cost.pipeline.bubble`), stage boundaries' sends;
- optimizer: AdamW reads and writes each shard's parameter, gradient and two states (memory-bound);
- what is hidden is not free: each second of communication overlapped with compute slows the compute
  by `overlap_cost` seconds (the collective's kernels take SMs and memory bandwidth).

Memory, per GPU, at the step's peak: parameters, gradients and optimizer states as the precision
keeps them ('bf16-mixed': fp32 master weights, fp32 gradients, fp32 AdamW states, bf16 copies for
compute, as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) trains), sharded over
dp_shard; with `shard_optimizer` the master weights and AdamW states also split over dp_replicate
(Megatron's distributed optimizer, ZeRO-1: gradients reduce-scattered, updated weights all-gathered);
FSDP2's gathered units; saved activations of the micro-batches in flight (`in_flight`); the loss's
temporaries; the runtime's own bytes; all times the allocator's reserve factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from passes.cost.cluster import Cluster
from passes.cost.pipeline import bubble, in_flight
from passes.cost.profile import Part, Profile

__all__ = ["FUSED", "Parallel", "StepCost", "TPBytes", "price_step", "step_bytes"]

FUSED = 0.5  # memory-bound traffic left once torch.compile fuses elementwise chains (inputs read once per chain)
PRECISIONS = {  # bytes per parameter: (held between steps: master weight + AdamW's 8, gradient, compute copy)
    "bf16-mixed": (4 + 8, 4, 2),
    "bf16": (2 + 8, 2, 0),
    "fp32": (4 + 8, 4, 0),
}


@dataclass(frozen=True)
class Parallel:
    """One parallel configuration of a training step (see `autopar.estimate`)."""

    tp: tuple = (1,)  # (t,) 1D, (R, C) 2D SUMMA, (q, q, q) the cube
    dp_shard: int = 1
    dp_replicate: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    interleave: int = 1  # stages per pipeline rank
    recompute: str = "none"  # none | selective | full
    precision: str = "bf16-mixed"
    compile: bool = False
    fp8: bool = False
    async_tp: bool = False
    shard_optimizer: bool = False  # master weights and AdamW states split over the replicas (ZeRO-1)
    recompute_blocks: int | None = None  # with recompute 'full': the first k blocks of each stage (None: all)
    overlap: bool = True  # 2D and 3D: the next SUMMA panel beside the current matmul (`overlap`); False: in line
    # context parallel: each sequence split over cp ranks (keys and values all-gathered per attention, their
    # gradients reduce-scattered); the parameters sharded over dp_shard x cp, as torchtitan runs it
    cp: int = 1
    cp_attention: str = "allgather"  # how an attention sees every token: 'allgather' (K, V), 'alltoall' (heads)
    #                                  or 'ring' (K, V passed around the cp ranks beside the block products)
    reshard_after_forward: bool = True  # FSDP2 without stages: a block released after its forward, gathered again
    #                                     for backward; False: kept gathered to its backward (one gather per step)

    @property
    def fsdp(self) -> int:
        """The ranks each parameter is sharded over: dp_shard, times cp (torchtitan's dp_shard_cp mesh)."""
        return self.dp_shard * self.cp

    @property
    def rest(self) -> str:
        """How the blocks not recomputed in full keep their activations."""
        return "none" if self.recompute == "full" else self.recompute

    def recomputed(self, per_stage: int) -> int:
        """Blocks of a stage of `per_stage` recomputed in full."""
        if self.recompute != "full":
            return 0
        return per_stage if self.recompute_blocks is None else min(self.recompute_blocks, per_stage)

    @property
    def tp_size(self) -> int:
        return math.prod(self.tp)

    @property
    def devices(self) -> int:
        return self.tp_size * self.dp_shard * self.dp_replicate * self.pp * self.cp

    def describe(self) -> str:
        tp = "x".join(map(str, self.tp))
        kept = " (kept after forward)" if not self.reshard_after_forward and self.pp == 1 else ""
        parts = [f"TP {tp}" if self.tp_size > 1 else "", f"FSDP {self.dp_shard}{kept}" if self.dp_shard > 1 else "",
                 f"CP {self.cp} ({self.cp_attention})" if self.cp > 1 else "",
                 (f"DP {self.dp_replicate}" + (" (optimizer sharded)" if self.shard_optimizer else ""))
                 if self.dp_replicate > 1 else "",
                 f"PP {self.pp} ({self.schedule}{f', V={self.interleave}' if self.interleave > 1 else ''}, "
                 f"M={self.microbatches})" if self.pp > 1 else "",
                 f"recompute {self.recompute}" + (f" ({self.recompute_blocks} blocks per stage)"
                                                  if self.recompute == "full" and self.recompute_blocks else "")]
        return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class TPBytes:
    """What tensor parallelism moves for one part, per GPU and micro-batch of `n` sequences:
    per_seq * n + fixed bytes per mesh axis, in `calls` collective calls per axis."""

    per_seq: tuple = (0.0, 0.0)
    fixed: tuple = (0.0, 0.0)
    calls: tuple = (0, 0)
    saved: tuple = (0.0, 0.0)  # (per sequence, fixed) bytes per rank its products keep beyond saved / tp
    fwd_per_seq: tuple = (0.0, 0.0)  # of the above, the forward's: what a recomputed forward moves again
    fwd_fixed: tuple = (0.0, 0.0)
    fwd_calls: tuple = (0, 0)

    def saved_bytes(self, n: float) -> float:
        """What the part's products keep for backward beyond its saved bytes split tp ways, for n sequences:
        the copies they read in another layout (1D's all-gathered inputs; `consumed_saved_bytes`)."""
        return self.saved[0] * n + self.saved[1]

    def bytes(self, n: float) -> tuple:
        return tuple(p * n + f for p, f in zip(self.per_seq, self.fixed))

    def fwd_bytes(self, n: float) -> tuple:
        return tuple(p * n + f for p, f in zip(self.fwd_per_seq, self.fwd_fixed))


@dataclass
class StepCost:
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    compute_s: float
    bubble_s: float
    exposed_s: dict  # link -> seconds of communication not hidden behind compute
    comm_s: dict  # link -> seconds of communication in all
    memory: dict  # category -> bytes per GPU

    @property
    def memory_bytes(self) -> float:
        return self.memory["total"]


def _gemm_s(m: float, k: float, n: float, cl: Cluster, fp8: bool) -> float:
    """One GEMM [m, k] x [k, n]: FLOPs at the reached rate, never faster than reading its operands."""
    rate = cl.peak_flops * cl.matmul_efficiency * (cl.fp8_speedup if fp8 else 1.0)
    small = min(m, k, n)
    rate *= small / (small + 64.0)  # tiles of 128: a dim of a few tiles leaves the tensor cores idle
    return max(2.0 * m * k * n / rate, 2.0 * (m * k + k * n + m * n) / (cl.hbm_bytes_per_s * cl.hbm_efficiency))


def _split(m, k, n, tp: tuple) -> tuple[float, float, float]:
    """A linear's local GEMM: 1D splits its output (or input) features t ways, 2D the tokens over R
    and the features over C, the cube over all three."""
    if len(tp) == 1:
        return m, k, n / tp[0]
    if len(tp) == 2:
        return m / tp[0], k, n / tp[1]
    return m / tp[0], k / tp[1], n / tp[2]


# Attention's backward beyond twice its forward: flash attention's backward runs five products against the
# forward's two, 2.5 times its FLOPs (FlashAttention-2, Dao 2023, section 4.1's FLOP count); so does the ring's.
ATTENTION_BWD_EXTRA = 0.5

# Bytes of HBM traffic per attention score in the ring flavour's forward (`passes.ops.ring_attention`, not a
# fused kernel; scores in float32): the score product written (4), scaled (4 + 4), the log-sum-exp's two passes
# (8), minus it and exp (8 + 8), read by the value product (4): 40. Backward runs about twice the forward's
# passes, as the model prices.
RING_SCORE_BYTES = 40.0


@dataclass
class _Work:
    fwd: float = 0.0  # seconds of one forward
    mm_fwd: float = 0.0  # of which matmuls
    sac_extra: float = 0.0  # what per-op selective recomputation runs again
    group_mm: tuple = ()  # seconds of each run of products reading one input (`Part.groups`)
    attn: float = 0.0  # of which attention

    def hidden(self, comm: float, k: float) -> float:
        """Seconds of `comm` (a 1D block's collectives, one per run of products, equal in size) that
        async TP hides: each collective behind its own run's matmuls only (`k` passes of them)."""
        if not self.group_mm:
            return 0.0
        each = comm / len(self.group_mm)
        return sum(min(each, k * g) for g in self.group_mm)


def _part_time(part: Part, n: float, cfg: Parallel, cl: Cluster) -> _Work:
    """Seconds of one part's forward on one GPU for a micro-batch of n sequences."""
    t = cfg.tp_size
    each = [_gemm_s(*_split(m * n, k, nn, cfg.tp), cl, cfg.fp8) for m, k, nn in part.mm]
    mm = sum(each)
    ratio = part.sac_recompute_flops / part.mm_flops if part.mm_flops else 0.0
    attn = part.attention_flops * n / t / (cl.peak_flops * cl.attention_efficiency)
    if cfg.cp > 1 and cfg.cp_attention == "ring":  # the ring's block products: matmuls, the scores through HBM
        attn = (part.attention_flops * n / t / (cl.peak_flops * cl.matmul_efficiency)
                + part.attention_scores * n / t * RING_SCORE_BYTES / (cl.hbm_bytes_per_s * cl.hbm_efficiency))
    mem = part.memory_bytes * n / t / (cl.hbm_bytes_per_s * cl.hbm_efficiency) * (FUSED if cfg.compile else 1.0)
    floor = part.ops * cl.op_s / 3.0  # op_s is forward and backward together; _Work holds a forward
    return _Work(mm + attn + mem + floor, mm, ratio * mm + mem,
                 tuple(sum(each[i] for i in g) for g in part.groups()), attn)


def _coll_s(nbytes: float, calls: float, cl: Cluster, span: int, size: int) -> float:
    """A collective over `size` ranks spread over `span` consecutive ones (`Cluster.group_link`)."""
    link = cl.group_link(span, size)
    return calls * link.alpha_s + nbytes / (link.beta_bytes_per_s * cl.collective_efficiency)


def _cp_exposed(cfg: Parallel, cl: Cluster, blk: _Work, q_bytes: float, kv_share: float) -> tuple:
    """(forward, backward) seconds of one attention's context-parallel traffic, `q_bytes` this rank's q block:
    all-gather, K and V gathered forward and their gradients reduce-scattered; all-to-all, q, k, v and the
    output exchanged each way: both in line. Ring: each of the cp − 1 K/V blocks travels beside one ring
    step's product (1/cp of the attention), backward beside its gradients' sums, the last sum's trip home
    in line."""
    if cfg.cp == 1:
        return 0.0, 0.0
    cp, span, kv = cfg.cp, cfg.cp * cfg.tp_size, kv_share * q_bytes
    if cfg.cp_attention == "ring":
        step = _coll_s(2 * kv, 1, cl, span, cp)  # one K/V block (or its gradients) from the previous rank
        each = blk.attn / cp  # one ring step's share of this rank's attention forward
        return (cp - 1) * max(0.0, step - each), (cp - 1) * max(0.0, 2 * step - 2 * each) + step
    if cfg.cp_attention == "alltoall":
        one = _coll_s((cp - 1) / cp * (2 * q_bytes + 2 * kv), 4, cl, span, cp)
    else:
        one = _coll_s((cp - 1) * 2 * kv, 2, cl, span, cp)
    return one, one


def _tp_spans(tp: tuple) -> tuple:
    """((span, members) of mesh axis 0's groups, of axis 1's): axis 1 innermost; the cube's axis 1 is
    its q*q face."""
    if len(tp) == 1:
        return ((1, 1), (tp[0], tp[0]))
    if len(tp) == 2:
        return ((tp[0] * tp[1], tp[0]), (tp[1], tp[1]))
    return ((math.prod(tp), tp[0]), (tp[1] * tp[2], tp[1] * tp[2]))


def step_bytes(prof: Profile, layers: int, tp_block: TPBytes, tp_outer: TPBytes, cfg: Parallel, batch: int,
               seq: int, weight_bytes: int, grad_bytes: int, crossing=None) -> dict:
    """What one step moves, per grid position summed over the pipeline stages (one rank of each), by kind:
    'tp' bytes and 'tp_calls' (every micro-batch's blocks and outer part; a fully recomputed block's forward
    collectives again), 'fsdp' (each parameter gathered at `weight_bytes` -- twice without stages, resharded
    after forward; once inside a pipeline, kept gathered -- and its gradient reduce-scattered at
    `grad_bytes`; the root unit, embedding and head, gathered once), 'ddp' (a ring all-reduce of the
    gradients) and 'pp' (each micro-batch's activation forward and its gradient back across every stage
    boundary, `crossing` as `price_step` takes it). What `autopar.dry_run` counts, set beside it by
    `autopar estimate --dry-run`."""
    dp = cfg.dp_shard * cfg.dp_replicate
    M, S = cfg.microbatches, cfg.pp
    n = batch / dp / M / cfg.cp
    # a recomputed block's forward collectives run again
    stages = S * cfg.interleave
    rec = min(layers, cfg.recomputed(math.ceil(layers / stages)) * stages)
    tp = M * (layers * sum(tp_block.bytes(n)) + rec * sum(tp_block.fwd_bytes(n)) + sum(tp_outer.bytes(n)))
    tp_calls = M * (layers * sum(tp_block.calls) + rec * sum(tp_block.fwd_calls) + sum(tp_outer.calls))
    blocks = layers * prof.block.params / cfg.tp_size
    params = blocks + prof.outer.params / cfg.tp_size  # all stages' at one grid position
    share = (cfg.fsdp - 1) / cfg.fsdp
    again = 2 if S == 1 and cfg.reshard_after_forward else 1
    gathered = again * blocks + params - blocks  # FSDP2 keeps the root unit gathered all step
    fsdp = share * (gathered * weight_bytes + params * grad_bytes) if cfg.fsdp > 1 else 0.0
    r = cfg.dp_replicate
    ddp = (r - 1) / r * params / cfg.fsdp * _replica_bytes(cfg, grad_bytes, weight_bytes) if r > 1 else 0.0
    pp = M * (S - 1) * _boundary_bytes(prof, cfg, n, seq, crossing)
    return {"tp": tp, "tp_calls": tp_calls, "fsdp": fsdp, "ddp": ddp, "pp": pp}


def _replica_bytes(cfg: Parallel, grad_bytes: float, weight_bytes: float) -> float:
    """Bytes per parameter times (r-1)/r that the replicas move per step: a ring all-reduce of the gradients
    (twice their bytes), or with the optimizer sharded a reduce-scatter of the gradients and an all-gather of
    the updated weights (Megatron's distributed optimizer)."""
    return grad_bytes + weight_bytes if cfg.shard_optimizer else 2 * grad_bytes


def _boundary_bytes(prof: Profile, cfg: Parallel, n: float, seq: int, crossing) -> float:
    """Bytes one stage boundary sends per micro-batch of n sequences, forward and backward: `crossing`, the
    plan's ((per sequence, fixed) forward, backward) (`autopar.planning.estimate.boundary`), else the hidden
    state split over the TP ranks each way."""
    if crossing is None:
        return 2 * n * seq * prof.hidden * prof.param_dtype_bytes / cfg.tp_size
    return sum(per * n + fixed for per, fixed in crossing)


def price_step(prof: Profile, layers: int, tp_block: TPBytes, tp_outer: TPBytes, cfg: Parallel, cl: Cluster,
               batch: int, seq: int, crossing=None, kv_share: float = 1.0) -> StepCost:
    """The step of `batch` sequences of `seq` tokens over `cfg.devices` GPUs (see the module text);
    `crossing`: what a stage boundary sends (`_boundary_bytes`); `kv_share`: KV heads over query heads (what
    context parallelism gathers per token)."""
    dp = cfg.dp_shard * cfg.dp_replicate
    local = batch / dp  # sequences per data-parallel rank and step
    M = cfg.microbatches
    n = local / M / cfg.cp  # sequences per micro-batch (with cp: each rank's 1/cp of their tokens)
    S, V = cfg.pp, cfg.interleave
    per_stage = math.ceil(layers / (S * V))  # blocks per stage (the fullest)
    per_rank = per_stage * V
    blk, out = _part_time(prof.block, n, cfg, cl), _part_time(prof.outer, n, cfg, cl)
    spans = _tp_spans(cfg.tp)
    # tensor parallelism, per micro-batch: a block's and the outer part's collectives
    tp_blk = sum(_coll_s(b, c, cl, *s) for b, c, s in zip(tp_block.bytes(n), tp_block.calls, spans))
    tp_again = sum(_coll_s(b, c, cl, *s) for b, c, s in zip(tp_block.fwd_bytes(n), tp_block.fwd_calls, spans))
    tp_out = sum(_coll_s(b, c, cl, *s) for b, c, s in zip(tp_outer.bytes(n), tp_outer.calls, spans))
    # context parallel, per block and micro-batch (`passes.cost.context`)
    cp_fwd, cp_bwd = _cp_exposed(cfg, cl, blk, n * seq * prof.hidden * prof.param_dtype_bytes / cfg.tp_size, kv_share)
    tp_blk, tp_again = tp_blk + cp_fwd + cp_bwd, tp_again + cp_fwd

    full = cfg.recomputed(per_stage) * V  # this rank's blocks recomputed in full; the rest as `cfg.rest` says

    def block_s(w: _Work, comm: float, mode: str, again: float = 0.0) -> float:
        run = 3.0 * w.fwd + ATTENTION_BWD_EXTRA * w.attn \
            + (w.fwd if mode == "full" else w.sac_extra if mode == "selective" else 0.0)
        k = 4.0 if mode == "full" else 3.0
        comm += again if mode == "full" else 0.0  # a recomputed forward runs its collectives again
        if len(cfg.tp) > 1 and cfg.overlap:  # SUMMA's broadcasts overlap its products, all but each product's first
            exposed = max(comm / max(cfg.tp), comm - k * w.mm_fwd)
        elif len(cfg.tp) > 1:  # overlap=False: every panel waited for before its matmul
            exposed = comm
        else:
            exposed = comm - (w.hidden(comm, k) if cfg.async_tp else 0.0)
        return run + exposed + cl.overlap_cost * (comm - exposed)

    def blocks_s(comm: float, again: float) -> float:
        return full * block_s(blk, comm, "full", again) + (per_rank - full) * block_s(blk, comm, cfg.rest)

    edge = block_s(out, tp_out, "none")  # embedding, final norm, head and loss: never recomputed
    work = M * (blocks_s(tp_blk, tp_again) + edge)
    tp_exposed = work - M * (blocks_s(0.0, 0.0) + block_s(out, 0.0, "none"))
    idle = bubble(cfg.schedule, S, M, V) if S > 1 else 0.0
    bubble_s = work * idle / (1 - idle) if S > 1 else 0.0
    compute_s = work
    tp_total = M * (per_rank * tp_blk + full * tp_again + tp_out)  # a recomputed block's forward ones again
    # pipeline sends: each micro-batch's activations forward and their gradients back, per stage boundary
    sent = _boundary_bytes(prof, cfg, n, seq, crossing)  # forward and backward, per micro-batch
    pp_s = V * M * _coll_s(sent, 2, cl, cfg.tp_size * dp * S, S) if S > 1 else 0.0
    # data parallelism, per step
    block_params = prof.block.params
    stage_params = (per_rank * block_params + prof.outer.params / (1 if S == 1 else 2)) / cfg.tp_size
    held, grad_b, copy_b = PRECISIONS[cfg.precision]
    gather = copy_b or held - 8  # bytes per parameter gathered: the compute copy (bf16), else the weight
    dp_span = cfg.fsdp * cfg.tp_size
    fsdp_s = first = 0.0
    if cfg.fsdp > 1:
        share = (cfg.fsdp - 1) / cfg.fsdp
        again = 2 if S == 1 and cfg.reshard_after_forward else 1  # resharded after forward: gathered again; root once
        units = per_rank + 1
        blocks = per_rank * block_params / cfg.tp_size
        fsdp_s = _coll_s(share * ((again * blocks + stage_params - blocks) * gather + stage_params * grad_b),
                         units * (again + 1), cl, dp_span, cfg.fsdp)
        first = _coll_s(share * block_params / cfg.tp_size * (gather + grad_b), 2, cl, dp_span, cfg.fsdp)
    ddp_s = 0.0
    if cfg.dp_replicate > 1:
        r_share = (cfg.dp_replicate - 1) / cfg.dp_replicate * _replica_bytes(cfg, grad_b, gather) / cfg.fsdp
        r_span = cfg.dp_replicate * dp_span
        ddp_s = _coll_s(r_share * stage_params, (per_rank + 1) * (1 + cfg.shard_optimizer), cl, r_span,
                        cfg.dp_replicate)  # a bucket per block and the rest: all-reduce, or reduce-scatter + all-gather
        # the last bucket's reduction (a block's gradients) waits for the end of backward
        first += _coll_s(r_share * block_params / cfg.tp_size, 1 + cfg.shard_optimizer, cl, r_span,
                         cfg.dp_replicate)
    hideable = compute_s  # replicas' collectives run beside the step's compute
    dp_exposed = max(first, fsdp_s + ddp_s - hideable + first)
    dp_exposed += cl.overlap_cost * (fsdp_s + ddp_s - dp_exposed if fsdp_s + ddp_s > dp_exposed else 0.0)
    updated = stage_params / cfg.fsdp / (cfg.dp_replicate if cfg.shard_optimizer else 1)  # this rank's update
    opt_s = updated * (held + grad_b + held + copy_b) / (cl.hbm_bytes_per_s * cl.hbm_efficiency)
    step = compute_s + bubble_s + dp_exposed + pp_s + opt_s
    tokens = batch * seq
    model_flops = 3.0 * (layers * (prof.block.mm_flops + prof.block.attention_flops)
                         + prof.outer.mm_flops + prof.outer.attention_flops) * batch
    devices = cfg.devices
    tp_link = "intra-node" if max(s for s, _ in spans) <= cl.gpus_per_node else "inter-node"
    dp_link = "intra-node" if cfg.dp_replicate * dp_span <= cl.gpus_per_node else "inter-node"
    tp_name = "tp+cp " if cfg.cp > 1 else "tp "  # context parallel's collectives priced with tensor parallel's
    exposed = {tp_name + tp_link: tp_exposed, "dp " + dp_link: dp_exposed,
               "pp": pp_s}
    comm = {tp_name + tp_link: tp_total, "dp " + dp_link: fsdp_s + ddp_s, "pp": pp_s}
    memory = _memory(prof, cfg, cl, per_rank, full, n, stage_params, tp_block, tp_outer)
    return StepCost(step, tokens / step / devices, model_flops / step / devices / cl.peak_flops, compute_s,
                    bubble_s, exposed, comm, memory)


def _memory(prof: Profile, cfg: Parallel, cl: Cluster, per_rank: int, full: int, n: float, stage_params: float,
            tp_block: TPBytes, tp_outer: TPBytes) -> dict:
    """Bytes per GPU at the step's peak, by category (see the module docstring); `full` of the rank's
    `per_rank` blocks recomputed in full, the others as `cfg.recompute` says."""
    held, grad_b, copy_b = PRECISIONS[cfg.precision]
    weight_b = copy_b or held - 8  # what a gathered parameter takes: the compute copy, else the weight itself
    shard = stage_params / cfg.fsdp
    states, grads = shard * held / (cfg.dp_replicate if cfg.shard_optimizer else 1), shard * grad_b
    block_params = prof.block.params / cfg.tp_size
    if cfg.fsdp > 1 and cfg.pp == 1 and cfg.reshard_after_forward:  # FSDP2: the root, the running block and the
        # prefetched one gathered, two blocks' unsharded gradients
        gathered = (prof.outer.params / cfg.tp_size + 2 * block_params) * weight_b + 2 * block_params * grad_b
    elif cfg.fsdp > 1 and cfg.pp == 1:  # kept after forward: every block gathered when backward starts
        gathered = stage_params * weight_b + 2 * block_params * grad_b
    elif cfg.fsdp > 1:  # inside a pipeline: the stage stays gathered, its gradients unsharded until the end
        gathered = stage_params * (weight_b + grad_b)
    else:
        gathered = stage_params * copy_b
    t = cfg.tp_size
    keep = {"none": prof.block.saved, "selective": prof.block.sac_saved, "full": prof.block.input_bytes}
    copies = tp_block.saved_bytes(n)  # gathered inputs the products of a block not recomputed in full keep
    per_mb = (keep["full"] * n / t * full  # one micro-batch's saved activations on this rank
              + (keep[cfg.rest] * n / t + copies) * (per_rank - full))
    rebuilt = (prof.block.saved * n / t + tp_block.saved_bytes(n)) if cfg.recompute != "none" else 0.0
    if 0 < full < per_rank:  # the first blocks: rebuilt after backward has freed the later blocks' activations
        rebuilt = max(0.0, keep["full"] * n / t * full + rebuilt - per_mb)
    head = prof.outer.saved * n / t + tp_outer.saved_bytes(n)
    temporaries = 2 * prof.outer.largest_output * n / t  # the loss's fp32 logits and their gradient
    if cfg.pp == 1:
        activations, temps = per_mb + head, temporaries
    else:  # the first rank holds the most micro-batches; the last one holds one, with the head and the loss
        flight = in_flight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.interleave)
        activations, temps = max(per_mb * flight, per_mb + head + temporaries), 0.0
    tensors = states + grads + gathered + activations + rebuilt + temps
    return {"parameters_and_optimizer": states, "gradients": grads, "gathered": gathered,
            "activations": activations + rebuilt, "temporaries": temps, "runtime": cl.runtime_bytes,
            "reserve": tensors * (cl.reserve_factor - 1), "total": tensors * cl.reserve_factor + cl.runtime_bytes}
