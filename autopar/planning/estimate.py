"""`estimate`: what one training step of a given parallel configuration costs on a given cluster.

    est = autopar.estimate("config.json", devices=256, cluster="grand-teton-h100", batch=512, seq=8192,
                           tp=8, dp_shard=32, recompute="full")
    est.step_s, est.tokens_per_s_per_gpu, est.mfu, est.memory_gib_per_rank

The model (a transformers config, its `config.json`, or an `nn.Module`, on the meta device or not) is
captured on one process without the hardware -- a config with at most `DEPTH` blocks, the rest
counted by the model's depth -- for one and for two sequences, and read as a `Profile`
(`passes.cost.profile`); the tensor-parallel layout's bytes are the plan's own (`part_costs`, the
counts `parallelize` runs with); `passes.cost.step` prices the rest. Captures are cached per model,
sequence length and dtype, so estimating many configurations of one model costs one capture pair.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from autopar.errors import UsageError
from passes.cost.cluster import PRESETS, resolve_cluster
from passes.cost.profile import profile
from passes.cost.step import PRECISIONS, Parallel, StepCost, TPBytes, price_step
from passes.cost.context import FLAVOURS, can_run, flavour

__all__ = ["Estimate", "ModelSource", "boundary", "estimate", "head_columns", "load_model_source", "model_profile",
           "tp_bytes"]

DEPTH = 3  # blocks a config's model is built with: the middle one stands for all
SUMMA_LOWERING = "broadcast"  # every SUMMA product's, in the plan's bytes and calls that `tp_bytes` scales
RECOMPUTE = ("none", "selective", "full")


@dataclass
class ModelSource:
    """A model the estimate can capture: built from a transformers config, or given."""

    name: str
    layers: int  # repeated blocks of the full model
    build: object  # () -> (nn.Module with at most DEPTH blocks or all of them, example kwargs maker)
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    cache: dict = field(default_factory=dict)
    whole: object = None  # () -> the model with all its blocks (on the meta device for a config), or None: build


def load_model_source(model, dtype=torch.bfloat16) -> ModelSource:
    """A `ModelSource` from a transformers config, the path of a `config.json`, or an nn.Module."""
    if isinstance(model, ModelSource):
        return model
    try:
        import transformers
    except ImportError:
        raise UsageError("autopar.estimate builds models from transformers configs: pip install 'autopar[hf]' "
                         "(transformers)") from None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise UsageError(f"autopar.estimate: {model!r} is no config.json file (or folder holding one)")
        with open(path) as f:
            data = json.load(f)
        if "model_type" not in data:
            raise UsageError(f"autopar.estimate: {path} has no 'model_type': expected a transformers config.json")
        model = transformers.AutoConfig.for_model(**data)
    if isinstance(model, transformers.PretrainedConfig):
        return _config_source(model, dtype)
    if isinstance(model, torch.nn.Module):
        return _module_source(model)
    raise UsageError(f"autopar.estimate: model={type(model).__name__}: expected a transformers config, the path "
                     f"of a config.json, or an nn.Module")


def _config_source(config, dtype) -> ModelSource:
    import transformers

    layers = getattr(config, "num_hidden_layers", None)
    if not layers:
        raise UsageError(f"autopar.estimate: {type(config).__name__} has no num_hidden_layers")
    experts = next((getattr(config, k) for k in ("num_local_experts", "n_routed_experts", "num_experts")
                    if isinstance(getattr(config, k, None), int) and getattr(config, k) > 1), None)
    if experts:
        raise UsageError(f"autopar.estimate: {type(config).__name__} is a mixture of experts ({experts} experts "
                         f"per block): the roofline prices dense blocks only (its experts' products and routing "
                         f"are not counted); use autopar.plan for its bytes")
    depth = min(layers, DEPTH)
    fields = {k: v[:depth] if isinstance(v, list) and len(v) == layers else v  # per-layer lists (layer_types)
              for k, v in config.to_dict().items()}
    small = type(config).from_dict({**fields, "num_hidden_layers": depth, "use_cache": False})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(small, key, None) is not None:
            setattr(small, key, 0)
    auto = transformers.AutoModelForCausalLM

    def build(cfg=small):
        """The model with DEPTH blocks on the meta device (its buffers too), and its inputs."""
        with torch.device("meta"):
            m = auto.from_config(cfg)
        return m.to(dtype), lambda n, s: {"input_ids": torch.zeros(n, s, dtype=torch.long),
                                          "labels": torch.zeros(n, s, dtype=torch.long)}

    def whole():
        full = type(config).from_dict({**config.to_dict(), "use_cache": False})
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(full, key, None) is not None:
                setattr(full, key, 0)
        return build(full)[0]
    return ModelSource(getattr(config, "model_type", type(config).__name__), layers, build,
                       getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None),
                       getattr(config, "vocab_size", None), whole=whole)


def _module_source(module) -> ModelSource:
    from passes.nodes import repeated_blocks

    config = getattr(module, "config", None)
    blocks = repeated_blocks(name for name, _ in module.named_modules())
    if config is None:
        raise UsageError("autopar.estimate: an nn.Module without a transformers config: pass its config (or "
                         "config.json) instead, or use autopar.plan for a model of your own")

    from autopar.program.build import cache_off_kwargs

    def build():
        return module, lambda n, s: {"input_ids": torch.zeros(n, s, dtype=torch.long),
                                     "labels": torch.zeros(n, s, dtype=torch.long), **cache_off_kwargs(module)}
    return ModelSource(type(module).__name__, len(blocks), build, getattr(config, "num_attention_heads", None),
                       getattr(config, "num_key_value_heads", None), getattr(config, "vocab_size", None))


@dataclass
class Estimate:
    """One configuration's estimated step (all figures per GPU; see `passes.cost.step`)."""

    model: str
    devices: int
    cluster: str
    batch: int
    seq: int
    parallel: Parallel
    cost: StepCost

    @property
    def step_s(self) -> float:
        return self.cost.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.cost.tokens_per_s_per_gpu

    @property
    def mfu(self) -> float:
        return self.cost.mfu

    @property
    def memory_gib_per_rank(self) -> float:
        return self.cost.memory_bytes / 2**30

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {"model": self.model, "devices": self.devices, "cluster": self.cluster, "batch": self.batch,
                "seq": self.seq, "parallel": asdict(self.parallel), "step_s": self.step_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "memory_gib_per_rank": self.memory_gib_per_rank, "compute_s": self.cost.compute_s,
                "bubble_s": self.cost.bubble_s, "exposed_comm_s": self.cost.exposed_s, "comm_s": self.cost.comm_s,
                "memory_gib": {k: v / 2**30 for k, v in self.cost.memory.items()}}

    def __str__(self) -> str:
        mem = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in self.cost.memory.items() if k != "total")
        exposed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.cost.exposed_s.items() if v)
        return (f"{self.model} on {self.devices} GPUs ({self.cluster}), batch {self.batch} x {self.seq}: "
                f"{self.parallel.describe()}\n"
                f"  step {self.step_s:.3f} s, {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {self.mfu:.1%}\n"
                f"  compute {self.cost.compute_s:.3f} s, bubble {self.cost.bubble_s:.3f} s, exposed communication: "
                f"{exposed or 'none'}\n"
                f"  memory {self.memory_gib_per_rank:.1f} GiB per GPU ({mem} GiB)")


def captured(src: ModelSource, seq: int, n: int):
    """The graph of `src` for `n` sequences of `seq` tokens (cached on `src`)."""
    key = ("graph", seq, n)
    if key not in src.cache:
        from passes import capture  # the graph as traced: on meta for a meta model (nothing to run)

        model, inputs = src.build()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs(n, seq).items()}
        src.cache[key] = capture(model, (), kwargs).gm
    return src.cache[key]


def model_profile(src: ModelSource, seq: int) -> tuple:
    """(Profile, the captured graph of one sequence) for `seq`, cached on `src`."""
    key = ("profile", seq)
    if key not in src.cache:
        g = captured(src, seq, 1)
        src.cache[key] = (profile(g), g)
    return src.cache[key]


def rows(tp: tuple) -> int:
    """The mesh rows that split each micro-batch's sequences: 2D's R, the cube's q, none for 1D."""
    return tp[0] if len(tp) > 1 else 1


def boundary(src: ModelSource, seq: int, tp: tuple) -> tuple:
    """((per sequence, fixed) forward bytes, the same backward) per rank that a pipeline stage boundary
    (before a block) sends per micro-batch under layout `tp`: the block's outside inputs in the plan's
    layouts (its hidden state, the attention mask, rotary tables), read as a line in the sequences."""
    key = ("boundary", seq, tuple(tp))
    if key not in src.cache:
        from passes.search.plan_bytes import boundary_bytes

        prof = model_profile(src, seq)[0]
        r = rows(tp)
        strategy, mesh = ({1: ("1d", (1, tp[0])), 2: ("2d", tuple(tp)), 3: ("3d", (tp[0], tp[0] * tp[0]))}[len(tp)]
                          if math.prod(tp) > 1 else ("1d", (1, 1)))
        block = prof.block_ids[1] if len(prof.block_ids) > 2 else prof.block_ids[0]
        one, two = (boundary_bytes(captured(src, seq, k), mesh, strategy, block) for k in (r, 2 * r))
        src.cache[key] = tuple(((b - a) / r, 2 * a - b) for a, b in zip(one, two))
    return src.cache[key]


def tp_bytes(src: ModelSource, seq: int, tp: tuple, assignment: dict | None = None) -> tuple:
    """(a block's TPBytes, the outer part's) of layout `tp` for `seq`: the plan's bytes for r and 2r
    sequences (r: `rows(tp)`, so that every row holds whole sequences), read as a line in the sequences."""
    if math.prod(tp) == 1:
        return TPBytes(), TPBytes()
    key = ("tp", seq, tuple(tp))
    if key in src.cache:
        return src.cache[key]
    from passes.cost.model import CostModel
    from passes.search.plan_bytes import consumed_saved_bytes
    from passes.search.strategy import part_costs

    prof = model_profile(src, seq)[0]
    r = rows(tp)
    g1, g2 = captured(src, seq, r), captured(src, seq, 2 * r)
    strategy, mesh = {1: ("1d", (1, tp[0])), 2: ("2d", tuple(tp)), 3: ("3d", (tp[0], tp[0] * tp[0]))}[len(tp)]
    block = prof.block_ids[1] if len(prof.block_ids) > 2 else prof.block_ids[0]
    cm = CostModel((0.0, 0.0), (1.0, 1.0), math.inf, "bytes")
    calls = [CostModel(tuple(float(a == ax) for a in range(2)), (math.inf, math.inf), math.inf, "calls")
             for ax in range(2)]
    # (block, rest, the block's forward, the rest's forward) of each graph, and of g1 priced in calls per axis
    costs = [part_costs(g, mesh, cm, strategy, block, lowering=SUMMA_LOWERING, assignment=assignment, forward=True)
             for g in (g1, g2)]
    counted = [part_costs(g1, mesh, c, strategy, block, lowering=SUMMA_LOWERING, assignment=assignment,
                          forward=True) for c in calls]
    out = []
    for part in (0, 1):
        line, n_calls = {}, {}
        for phase, i in (("step", part), ("fwd", part + 2)):  # the forward's: what a recomputed forward runs again
            ones = [c[i].bytes_per_axis for c in costs]
            line[phase] = (tuple((b - a) / r for a, b in zip(*ones)), tuple(2 * a - b for a, b in zip(*ones)))
            n_calls[phase] = tuple(round(c[i].time_s) for c in counted)
        copies = [consumed_saved_bytes(g, mesh, strategy, block if part == 0 else None) for g in (g1, g2)]
        out.append(TPBytes(*line["step"], n_calls["step"], ((copies[1] - copies[0]) / r, 2 * copies[0] - copies[1]),
                           *line["fwd"], n_calls["fwd"]))
    src.cache[key] = tuple(out)
    return src.cache[key]


def _tp_tuple(tp) -> tuple:
    if isinstance(tp, int):
        return (tp,)
    if isinstance(tp, str):
        try:
            tp = tuple(int(x) for x in tp.replace("x", ",").split(","))
        except ValueError:
            raise UsageError(f"autopar.estimate: tp={tp!r}: expected t, R,C or q,q,q (e.g. 8, 2,4 or 4,4,4)") from None
    tp = tuple(tp)
    if not tp or len(tp) > 3 or any(not isinstance(t, int) or t < 1 for t in tp) or \
            (len(tp) == 3 and len(set(tp)) != 1):
        raise UsageError(f"autopar.estimate: tp={tp!r}: expected t (1D), (R, C) (2D SUMMA) or (q, q, q) (the cube)")
    return tp


def head_columns(tp: tuple) -> int:
    """The ranks a layout splits attention heads over: 1D's t, 2D's C, the cube's q*q."""
    return tp[-1] if len(tp) == 2 else math.prod(tp) if len(tp) == 1 else tp[0] ** 2


def _check_shape(src: ModelSource, tp: tuple, pp: int, interleave: int, devices: int) -> None:
    """The dimensions against the model and the device count, before anything is priced."""
    t = head_columns(tp)
    n = src.heads  # key/value heads fewer than t are split unevenly by the plan (its reblocking): priced as it runs
    if n and n % t:
        ok = [d for d in range(1, n + 1) if n % d == 0 and devices % d == 0]
        raise UsageError(f"autopar.estimate: tp={t} does not divide the model's {n} attention heads: use one of {ok}")
    if not isinstance(pp, int) or pp < 1 or pp * interleave > src.layers:
        raise UsageError(f"autopar.estimate: pp={pp} x interleave={interleave} stages, but the model has {src.layers} "
                         f"blocks: use pp * interleave <= {src.layers}")
    if devices % (math.prod(tp) * pp):
        ok = [d for d in range(1, devices + 1) if devices % d == 0]
        raise UsageError(f"autopar.estimate: devices={devices} is not a multiple of tp {'x'.join(map(str, tp))} x "
                         f"pp {pp}: use dimensions whose product divides it (its divisors: {ok})")


def check(src: ModelSource, cfg: Parallel, devices: int, batch: int) -> None:
    """A clear error for a configuration that cannot run, naming what would."""
    from autopar.program.pipe import SCHEDULES, schedule_refusal

    if cfg.devices != devices:
        raise UsageError(f"autopar.estimate: tp {'x'.join(map(str, cfg.tp))} x dp_shard {cfg.dp_shard} x "
                         f"dp_replicate {cfg.dp_replicate} x pp {cfg.pp} x cp {cfg.cp} = {cfg.devices} GPUs, but "
                         f"devices={devices}: "
                         f"make their product {devices}")
    if cfg.schedule not in SCHEDULES:
        raise UsageError(f"autopar.estimate: schedule={cfg.schedule!r}: expected one of {sorted(SCHEDULES)}")
    dp = cfg.dp_shard * cfg.dp_replicate
    if batch % (dp * cfg.microbatches):
        raise UsageError(f"autopar.estimate: batch={batch} sequences do not split into {dp} data-parallel ranks x "
                         f"{cfg.microbatches} micro-batches: use a batch that is a multiple of {dp * cfg.microbatches}")
    n = batch // (dp * cfg.microbatches)
    if n % rows(cfg.tp):
        raise UsageError(f"autopar.estimate: tp {'x'.join(map(str, cfg.tp))} splits each micro-batch's sequences over "
                         f"its {rows(cfg.tp)} rows, but a micro-batch holds {n}: use a batch (or fewer micro-batches) "
                         f"that gives a multiple of {rows(cfg.tp)} sequences per micro-batch")
    if cfg.pp > 1:
        why = schedule_refusal(cfg.schedule, cfg.pp, cfg.interleave, cfg.microbatches)
        if why:
            raise UsageError(f"autopar.estimate: {why}")
    if cfg.recompute not in RECOMPUTE:
        raise UsageError(f"autopar.estimate: recompute={cfg.recompute!r}: expected one of {RECOMPUTE}")
    k = cfg.recompute_blocks
    if k is not None:
        per_stage = math.ceil(src.layers / (cfg.pp * cfg.interleave))
        if cfg.recompute != "full" or isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= per_stage:
            raise UsageError(f"autopar.estimate: recompute_blocks={k!r} with recompute={cfg.recompute!r}: expected "
                             f"recompute='full' and a number of blocks per stage in [1, {per_stage}] (None: all)")
    if cfg.precision not in PRECISIONS:
        raise UsageError(f"autopar.estimate: precision={cfg.precision!r}: expected one of {sorted(PRECISIONS)}")


def estimate(model, *, devices: int, cluster="dgx-h100", seq: int, batch: int | None = None,
             global_batch: int | None = None, tp=1, dp_shard: int | None = None,
             dp_replicate: int = 1, pp: int = 1, schedule: str = "1f1b", microbatches: int | None = None,
             interleave: int = 1, recompute: str = "none", precision: str = "bf16-mixed", compile: bool = False,
             fp8: bool = False, async_tp: bool = False, shard_optimizer: bool = False,
             assignment: dict | None = None, recompute_blocks: int | None = None, overlap: bool = True,
             cp: int = 1, cp_attention: str = "auto", reshard_after_forward: bool = True) -> Estimate:
    """The estimated step of sequences of `seq` tokens on `devices` GPUs of `cluster` (a preset's name,
    see `passes.cost.cluster.PRESETS`, or a Cluster): `batch` sequences per data-parallel rank
    (torchtitan's local batch size) or `global_batch` in all, split as given:
    `tp` t (1D), (R, C) (2D) or (q, q, q) (3D); `dp_shard` FSDP2 ranks (None: what the devices leave);
    `dp_replicate` replicas around them (HSDP when both > 1); `pp` stages with `schedule`,
    `microbatches` (None: one sequence per micro-batch and grid row where that gives at least one per
    stage, else pp) and
    `interleave` stages per rank; `recompute` 'none', 'selective' (per op, torchtitan's) or 'full';
    `recompute_blocks` with 'full': the first k blocks of each stage recomputed, the others not
    (Megatron's --recompute-num-layers; None: every block);
    `precision` 'bf16-mixed' (fp32 master weights, gradients and AdamW states), 'bf16' or 'fp32';
    `compile` (memory-bound ops fused), `fp8` (FP8 linears), `async_tp` (1D TP collectives overlapped);
    `shard_optimizer`: the replicas split the master weights and AdamW states (ZeRO-1, Megatron's distributed
    optimizer; priced, not built by `parallelize`);
    `assignment`: with a 2D `tp`, strategy='auto''s per-unit mix (`pmodel.choice.assignment`);
    `overlap` (2D and 3D): each SUMMA product's panels after the first travel beside the matmuls, as
    `parallelize(overlap=True)` runs them; False: every transfer in line;
    `cp`: context parallel, each sequence split over cp ranks, keys and values all-gathered per attention (their
    gradients reduce-scattered), exposed in line; the parameters sharded over dp_shard x cp, as torchtitan
    runs it (parallelize's context_parallel with data_parallel='shard');
    `reshard_after_forward` (dp_shard > 1 without stages): True releases each block's gathered parameters after
    its forward and gathers them again for its backward (FSDP2's default); False keeps them to its backward, one
    gather per step for the memory of every block gathered (parallelize's option of the same name; inside a
    pipeline a stage is kept gathered through its micro-batches either way);
    `cp_attention`: how an attention sees every token under cp: 'allgather' (K and V gathered, torchtitan's),
    'alltoall' (q, k, v and the output exchanged to and from head-split), 'ring' (K and V passed around the cp
    ranks, each block beside the previous block's product) or 'auto' (what parallelize's
    context_attention='auto' runs: all-to-all where the heads a rank holds, query and KV, divide by cp, else
    the ring; `passes.cost.context.flavour`)."""
    cl = resolve_cluster(cluster)
    if cl is None:
        raise UsageError(f"autopar.estimate: cluster=None: name one of {sorted(PRESETS)} or pass a Cluster")
    src = load_model_source(model)
    tp = _tp_tuple(tp)
    _check_shape(src, tp, pp, interleave, devices)
    if (batch is None) == (global_batch is None):
        raise UsageError("autopar.estimate: pass batch= (sequences per data-parallel rank) or global_batch= "
                         "(sequences per step in all), one of them")
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise UsageError(f"autopar.estimate: cp={cp!r}: expected a number of context-parallel ranks >= 1")
    if cp_attention not in ("auto",) + FLAVOURS:
        raise UsageError(f"autopar.estimate: cp_attention={cp_attention!r}: expected 'auto' or one of {FLAVOURS}")
    cols = head_columns(tp)
    heads = src.heads or 1
    mine = heads // cols, (src.kv_heads or heads) // cols  # the query and KV heads a rank holds
    if cp_attention == "auto":
        cp_attention = flavour(*mine, cp)
    why = can_run(cp_attention, *mine, cp, False) if cp > 1 else None
    if why:
        raise UsageError(f"autopar.estimate: cp_attention={cp_attention!r}: {why}")
    others = math.prod(tp) * dp_replicate * pp * cp
    shard = dp_shard if dp_shard is not None else devices // others if devices % others == 0 else 0
    if shard < 1:
        raise UsageError(f"autopar.estimate: devices={devices} is not a multiple of tp {'x'.join(map(str, tp))} x "
                         f"dp_replicate {dp_replicate} x pp {pp} x cp {cp}")
    dp = shard * dp_replicate
    if global_batch is None:
        global_batch = batch * dp
    batch = global_batch
    local = batch // dp
    m = microbatches if microbatches is not None else pp
    if microbatches is None and pp > 1 and local // rows(tp) >= pp:
        m = local // rows(tp)  # one sequence per grid row and micro-batch (torchtitan's micro-batch size 1)
    cfg = Parallel(tp, shard, dp_replicate, pp, schedule, m, interleave, recompute, precision, compile, fp8, async_tp,
                   shard_optimizer, recompute_blocks, overlap, cp, cp_attention, bool(reshard_after_forward))
    check(src, cfg, devices, batch)
    prof = model_profile(src, seq)[0]
    tb, to = tp_bytes(src, seq, tp, assignment)
    kv_share = (src.kv_heads or src.heads or 1) / (src.heads or 1)
    cost = price_step(prof, src.layers, tb, to, cfg, cl, batch, seq, boundary(src, seq, tp) if pp > 1 else None,
                      kv_share)
    return Estimate(src.name, devices, cl.name, batch, seq, cfg, cost)

