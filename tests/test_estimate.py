"""`autopar.estimate`, `choose_plan` and the published record (issue 52): the profile against the
architecture's own formulas, the tensor-parallel bytes against what the collective layer counts in a
dry run, the errors a user meets, and the estimate against published, measured runs."""

import dataclasses
import math

import pytest
import torch
from transformers import AutoConfig

from autopar.errors import MemoryLimitError, UsageError
from autopar.cli_estimate import dry_run_check
from autopar.planning.estimate import estimate, load_model_source, model_profile, tp_bytes
from autopar.planning.search import choose_plan, tp_layouts
from passes.cost.cluster import PRESETS

H, INTER, HEADS, KV, LAYERS, VOCAB = 64, 160, 8, 4, 4, 256


def tiny(**over):
    cfg = dict(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV,
               num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    cfg.update(over)
    return load_model_source(AutoConfig.for_model("llama", **cfg))


def test_profile_is_the_architectures_formulas():
    """Per token, a Llama block's products are 2 h (h + 2 kv d + h + 3 INTER) FLOPs and its causal attention
    2 s h (half of 4 s h: the masked half skipped); the head 2 h V. Catches a product counted twice, a
    missed one, attention priced without its causal half, and a batch that does not divide out."""
    src, seq = tiny(), 64
    prof = model_profile(src, seq)[0]
    d = H // HEADS
    per_token = 2 * H * (H + 2 * KV * d + H + 3 * INTER)
    assert prof.block.mm_flops == pytest.approx(per_token * seq, rel=1e-12)
    assert prof.block.attention_flops == pytest.approx(2 * seq * H * seq, rel=1e-12)
    assert prof.outer.mm_flops == pytest.approx(2 * H * VOCAB * seq, rel=1e-12)
    assert prof.blocks == 3 and prof.hidden == H  # built with DEPTH blocks, priced for all LAYERS
    assert prof.block.params == 2 * H * H + 2 * H * KV * d + 3 * H * INTER + 2 * H


def test_saved_activations_grow_linearly_in_the_sequence():
    """Flash attention keeps O(s) (its output and log-sum-exp), never the [s, s] scores this CPU/meta
    run's kernel keeps: the saved bytes per token of a block are the same at s = 128 and s = 512. The
    weights a linear keeps for backward are parameters, not activations."""
    src = tiny()
    a, b = model_profile(src, 128)[0].block, model_profile(src, 512)[0].block
    assert a.saved / 128 == pytest.approx(b.saved / 512, rel=0.02)
    assert a.saved / 128 < 200 * H  # bytes per token: tens of h, not h * s
    assert a.input_bytes / 128 == 2 * H  # the block input in bf16: what full recomputation keeps
    assert a.input_bytes < a.sac_saved < a.saved


CONFIGS = [dict(tp=(2,)), dict(tp=(2, 2)), dict(tp=(2,), dp_shard=2),
           dict(tp=(2,), dp_shard=2, reshard_after_forward=False), dict(pp=2, dp_shard=2),
           dict(tp=(2,), recompute="full", recompute_blocks=1)]


@pytest.mark.parametrize("config", CONFIGS,
                         ids=["1d", "2d", "1d-fsdp2", "1d-fsdp2-kept", "pp2-fsdp2", "1d-recompute-1"])
def test_the_dry_run_moves_and_holds_what_the_estimate_says(config):
    """The estimate of a configuration against a dry run of `parallelize`'s program for it (the whole model,
    every rank position covered): tensor-parallel bytes and calls and pipeline sends equal to the byte;
    FSDP2's gathers and reduce-scatters equal but for its dim-0 padding (under 1%), a pipeline's gathered once
    per step (not per micro-batch); the parameters a rank holds equal (0.5%); the most bytes a rank keeps
    saved for backward within 10% of the estimate's activations (flash-style attention on both sides)."""
    src = tiny()
    devices = math.prod(config.get("tp", (1,))) * config.get("dp_shard", 1) * config.get("pp", 1)
    rows = config.get("tp", (1,))[0] if len(config.get("tp", (1,))) > 1 else 1
    est = estimate(src, devices=devices, cluster="dgx-h100", seq=32, global_batch=2 * rows * devices, **config)
    got = dry_run_check(est, src)["compare"]
    for kind in ("tp", "tp_calls", "ddp", "pp"):
        assert got[kind]["dry_run"] == pytest.approx(got[kind]["estimate"], abs=0.5), (kind, got[kind])
    # FSDP2 pads each parameter's dim 0 to a multiple of the replicas; the estimate counts parameters unpadded
    assert got["fsdp"]["estimate"] <= got["fsdp"]["dry_run"] <= 1.01 * got["fsdp"]["estimate"], got["fsdp"]
    assert (got["fsdp"]["dry_run"] > 0) == ("dp_shard" in config)
    # the norms' weights, whole on every TP rank, the estimate splits with the rest (0.3% of this tiny model)
    assert got["params_per_rank"]["dry_run"] == pytest.approx(got["params_per_rank"]["estimate"], rel=5e-3)
    assert got["saved_bytes_peak"]["dry_run"] == pytest.approx(got["saved_bytes_peak"]["estimate"], rel=0.10)


def test_a_widening_cast_reduces_first():
    """transformers' RMSNorm upcasts its input to fp32; the 1D plan reduce-scatters the partial sum before
    the cast, in bf16: a block moves what Megatron with sequence parallelism moves, 8 collectives of
    (t - 1)/t of the [s, h] activation in bf16 (4 forward, 4 backward), plus the two norm weights'
    gradient all-reduces. The plan moved 1.5 times that when the collective ran after the cast."""
    src, seq, t = tiny(), 32, 4
    block, _ = tp_bytes(src, seq, (t,))
    megatron_sp = 8 * (t - 1) * seq * H // t * 2
    norms = 2 * 2 * (t - 1) * H // t * 2  # all-reduce of each [h] bf16 weight gradient: 2 (t-1)/t of it
    assert sum(block.bytes(1)) == megatron_sp + norms


def test_estimate_refuses_what_cannot_run():
    src = tiny()
    base = dict(devices=8, cluster="dgx-h100", seq=32, global_batch=8)
    heads = r"tp=16 does not divide the model's 8 attention heads: use one of \[1, 2, 4, 8\]"
    with pytest.raises(UsageError, match=heads):
        estimate(src, **{**base, "tp": 16})
    with pytest.raises(UsageError, match="pp=8 x interleave=1 stages, but the model has 4 blocks"):
        estimate(src, **{**base, "pp": 8})
    with pytest.raises(UsageError, match=r"devices=8 is not a multiple of tp 3 x pp 1"):
        estimate(tiny(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), **{**base, "tp": 3})
    with pytest.raises(UsageError, match="expected a Cluster, one of the presets .* or the path of an `autopar "
                                         "calibrate` JSON"):
        estimate(src, **{**base, "cluster": "tpu-v5"})
    with pytest.raises(UsageError, match="batch=8 sequences do not split into 8 data-parallel ranks x 2 micro-batches"):
        estimate(src, **{**base, "microbatches": 2, "pp": 1})
    with pytest.raises(UsageError, match="pass batch= .* or global_batch="):
        estimate(src, devices=8, seq=32)
    with pytest.raises(UsageError, match="recompute='some': expected one of"):
        estimate(src, **{**base, "recompute": "some"})
    with pytest.raises(UsageError, match="1F1B|1f1b|micro-batch"):
        estimate(src, **{**base, "pp": 4, "microbatches": 2, "global_batch": 4})
    rows = "tp 2x4 splits each micro-batch's sequences over its 2 rows, but a micro-batch holds 1"
    with pytest.raises(UsageError, match=rows):
        estimate(src, **{**base, "tp": (2, 4), "global_batch": 1})
    mixtral = AutoConfig.for_model("mixtral", hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                                   num_key_value_heads=KV, num_hidden_layers=LAYERS, vocab_size=VOCAB,
                                   num_local_experts=4)
    with pytest.raises(UsageError, match="MixtralConfig is a mixture of experts .4 experts per block.: the roofline "
                                         "prices dense blocks only"):
        estimate(mixtral, **base)
    with pytest.raises(UsageError, match="expected a transformers config"):
        estimate(42, **base)


def test_a_config_with_per_layer_fields_is_built_shallow():
    """Qwen2's config lists a type per layer (`layer_types`); the estimate builds the model with 3 blocks
    and must cut such lists to match (transformers refused the config before)."""
    qwen = AutoConfig.for_model("qwen2", hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                                num_key_value_heads=KV, num_hidden_layers=6, vocab_size=VOCAB)
    est = estimate(qwen, devices=2, cluster="dgx-h100", seq=32, global_batch=2, tp=2)
    assert est.step_s > 0 and model_profile(load_model_source(qwen), 32)[0].blocks == 3


def test_estimate_terms_follow_the_configuration():
    """Each dimension moves the figure it should: full recomputation costs time and saves memory; FSDP
    shards the states; more micro-batches shrink a pipeline's bubble; 1D TP's collectives are exposed
    and async TP hides some of them."""
    src = tiny()
    kw = dict(devices=8, cluster="dgx-h100", seq=64, global_batch=16)
    none, full = (estimate(src, devices=1, seq=64, batch=16, recompute=r) for r in ("none", "full"))
    assert full.step_s > none.step_s and full.cost.memory["activations"] < none.cost.memory["activations"]
    rep, shard = (estimate(src, **kw, dp_shard=s, dp_replicate=8 // s) for s in (1, 8))
    assert shard.cost.memory["parameters_and_optimizer"] == pytest.approx(
        rep.cost.memory["parameters_and_optimizer"] / 8)
    few, many = (estimate(src, **{**kw, "global_batch": 32}, pp=2, microbatches=m) for m in (2, 8))
    assert many.cost.bubble_s / many.step_s < few.cost.bubble_s / few.step_s
    mixed, pure = (estimate(src, **kw, dp_shard=8, precision=p) for p in ("bf16-mixed", "bf16"))
    # fp32 master weight + AdamW's two fp32 states (12 B) against a bf16 weight with them (10 B); gradients 4 B / 2 B
    assert pure.cost.memory["parameters_and_optimizer"] == pytest.approx(
        mixed.cost.memory["parameters_and_optimizer"] * 10 / 12)
    assert pure.cost.memory["gradients"] == pytest.approx(mixed.cost.memory["gradients"] / 2)
    plain, overlapped = (estimate(src, **kw, tp=4, async_tp=a) for a in (False, True))
    assert overlapped.step_s < plain.step_s and plain.cost.exposed_s["tp intra-node"] > 0


def test_a_sharded_optimizer_splits_the_states_over_the_replicas():
    """shard_optimizer (ZeRO-1, Megatron's distributed optimizer) on 8 replicas: the master weights and AdamW
    states (12 B per parameter under bf16-mixed) split 8 ways, the fp32 gradients kept whole, and the
    replicas' exchange a reduce-scatter of the gradients (4 B) and an all-gather of the bf16 weights (2 B)
    per parameter instead of an all-reduce of the gradients (2 x 4 B), each times 7/8."""
    from passes.cost.step import step_bytes

    src = tiny()
    kw = dict(devices=8, cluster="dgx-h100", seq=64, global_batch=16, dp_shard=1, dp_replicate=8)
    plain, zero1 = (estimate(src, **kw, shard_optimizer=z) for z in (False, True))
    assert zero1.cost.memory["parameters_and_optimizer"] == pytest.approx(
        plain.cost.memory["parameters_and_optimizer"] / 8, rel=1e-12)
    assert zero1.cost.memory["gradients"] == plain.cost.memory["gradients"]
    prof = model_profile(src, 64)[0]
    params = LAYERS * prof.block.params + prof.outer.params
    moved = [step_bytes(prof, LAYERS, *tp_bytes(src, 64, (1,)), e.parallel, 16, 64, 2, 4)["ddp"]
             for e in (plain, zero1)]
    assert moved == [7 / 8 * params * 8, 7 / 8 * params * 6]
    assert "optimizer sharded" in str(zero1)
    # bandwidth-bound (no launch latency), the fewer bytes are faster; on this tiny model's real links the step is
    # latency-bound, and two collectives per bucket cost more than one all-reduce
    cl = PRESETS["dgx-h100"]
    cl = dataclasses.replace(cl, intra=dataclasses.replace(cl.intra, alpha_s=0.0),
                             inter=dataclasses.replace(cl.inter, alpha_s=0.0))
    fast = [estimate(src, **{**kw, "cluster": cl}, shard_optimizer=z).cost.comm_s for z in (False, True)]
    assert sum(fast[1].values()) == pytest.approx(sum(fast[0].values()) * 6 / 8, rel=1e-9), fast
    with pytest.raises(UsageError, match="shard_optimizer"):  # parallelize does not build it: nothing to dry-run
        dry_run_check(zero1, src)


def test_choose_plan_beats_the_configurations_it_searches():
    """The pick is estimated at least as fast as every configuration in its space that fits (FSDP
    alone, TP inside the node, pipelines), fits the limit, and maps to parallelize's keywords."""
    src = tiny()
    plan = choose_plan(src, devices=8, cluster="dgx-h100", global_batch=16, seq=64)
    for other in (dict(dp_shard=8), dict(tp=2, dp_shard=4), dict(pp=2, microbatches=4, dp_shard=4)):
        est = estimate(src, devices=8, cluster="dgx-h100", global_batch=16, seq=64, **other)
        assert plan.best.tokens_per_s_per_gpu >= est.tokens_per_s_per_gpu * (1 - 1e-9)
    assert plan.best.cost.memory_bytes <= PRESETS["dgx-h100"].memory_bytes
    kw = plan.kwargs
    assert math.prod(kw["grid"]) * getattr(kw.get("pipeline"), "stages", 1) == 8
    _builds(plan)
    with pytest.raises(MemoryLimitError, match="no configuration of 8 GPUs fits 1.0 KiB per GPU"):
        choose_plan(src, devices=8, global_batch=16, seq=64, memory_limit=1024)


def _builds(plan):
    """`autopar.plan` (the passes parallelize runs, on one process) accepts the keywords of a candidate
    with pipeline stages over sharded replicas and of one with a 2D grid."""
    import transformers

    import autopar
    from autopar.checkpoint.hf import restore_buffers
    from autopar.planning.search import TrainingPlan

    cfg = AutoConfig.for_model("llama", hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                               num_key_value_heads=KV, num_hidden_layers=LAYERS, vocab_size=VOCAB,
                               max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)
    with autopar.meta_init():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    restore_buffers(model)
    ids = torch.zeros(16, 64, dtype=torch.long)
    picks = [next(e for e in plan.table if e.parallel.pp > 1 and e.parallel.dp_shard > 1),
             next(e for e in plan.table if len(e.parallel.tp) == 2)]
    for e in picks:
        kw = TrainingPlan(e, [e], 0, 0.0).kwargs
        assert autopar.plan(model, example_kwargs={"input_ids": ids, "labels": ids}, **kw) is not None, kw


def test_recomputing_some_blocks_prices_between_none_and_all():
    """recompute_blocks=k (the first k blocks of each stage recomputed, the rest keeping their activations):
    memory falls by the same step per block from recompute 'none' up to k = L - 1, and time rises likewise;
    k = L is 'full' exactly. Recomputing the last block too saves nothing more at the peak (backward
    rebuilds it first, while every other block's input is still held): L - 1 blocks hold less than L.
    Catches a partial count priced as all or none, or memory not linear in k."""
    src = tiny()
    base = dict(devices=8, cluster="dgx-h100", global_batch=16, seq=2048, dp_shard=8)
    none, full = (estimate(src, recompute=rc, **base) for rc in ("none", "full"))
    part = [estimate(src, recompute="full", recompute_blocks=k, **base) for k in range(1, LAYERS + 1)]
    assert part[-1].step_s == pytest.approx(full.step_s, rel=1e-12)
    assert part[-1].cost.memory_bytes == pytest.approx(full.cost.memory_bytes, rel=1e-12)
    mem = [none.cost.memory_bytes] + [e.cost.memory_bytes for e in part[:-1]]
    steps = [a - b for a, b in zip(mem, mem[1:])]  # the same saving per block recomputed
    assert min(steps) > 0 and max(steps) == pytest.approx(min(steps), rel=1e-9), steps
    assert part[-2].cost.memory_bytes < full.cost.memory_bytes
    times = [none.step_s] + [e.step_s for e in part]
    assert all(a < b for a, b in zip(times, times[1:])), times
    with pytest.raises(UsageError, match=r"recompute_blocks=2 with recompute='none': expected recompute='full'"):
        estimate(src, recompute="none", recompute_blocks=2, **base)
    with pytest.raises(UsageError, match=rf"blocks per stage in \[1, {LAYERS // 2}\]"):
        estimate(src, recompute="full", recompute_blocks=LAYERS, pp=2, **{**base, "dp_shard": 4})


def test_choose_plan_recomputes_the_fewest_blocks_that_fit():
    """Under a limit that keeping every activation exceeds and recomputing every block meets, the search
    also prices recomputing the first k blocks of each stage: its pick fits the limit, is faster than the
    same configuration with every block recomputed, and maps to parallelize's recompute='blocks',
    recompute_blocks=k."""
    src = tiny()
    base = dict(devices=8, cluster="dgx-h100", global_batch=16, seq=2048)
    none, full = (estimate(src, recompute=rc, dp_shard=8, **base) for rc in ("none", "full"))
    limit = (none.cost.memory_bytes + full.cost.memory_bytes) / 2
    plan = choose_plan(src, memory_limit=limit, tp=[(1,)], recompute=("none", "full"), schedules=("1f1b",),
                       max_stages=1, data_parallel=("shard",), **base)
    best = plan.best.parallel
    assert best.recompute == "full" and 1 <= best.recompute_blocks < LAYERS, best
    assert plan.best.cost.memory_bytes <= limit and plan.best.step_s < full.step_s
    fewer = estimate(src, recompute="full", recompute_blocks=best.recompute_blocks - 1, dp_shard=8, **base) \
        if best.recompute_blocks > 1 else none
    assert fewer.cost.memory_bytes > limit  # the fewest that fit
    assert plan.kwargs["recompute"] == "blocks" and plan.kwargs["recompute_blocks"] == best.recompute_blocks


def test_plans_beat_the_published_configurations():
    """Issue 52's item 4: for every published run whose configuration fits the cluster's memory by the
    estimate, choose_plan on the same model, devices, cluster and global batch (FP8, compile and async TP taken
    as the run used them) picks a configuration that parallelize builds, estimated at least as fast. Megatron-LM's
    runs use its distributed optimizer (ZeRO-1), which parallelize does not build: the pick beats them with
    FSDP2 (kept gathered from forward to backward: the same bytes, less memory). Left out and named: the runs
    whose own configuration the estimate puts above the GPU's 80 GB (one torchtitan A100 run without
    recomputation, Megatron's 314B and 462B), and torchtitan's 405B context-parallel runs (cp inside pipeline
    stages)."""
    from autopar.bench.published import CP_ROWS, ROWS
    from autopar.planning.architectures import published_model
    from autopar.program.spec import spec_of_dimensions

    cache, beaten, left = {}, [], []
    for r in ROWS + CP_ROWS:
        src = load_model_source(published_model(r.model, cache))
        pub = estimate(src, devices=r.devices, cluster=r.cluster, global_batch=r.batch, seq=r.seq, **r.config)
        cp_in_stages = r.config.get("cp", 1) > 1 and r.config.get("pp", 1) > 1
        if pub.cost.memory_bytes > PRESETS[r.cluster].memory_bytes or cp_in_stages:
            left.append(r.name)
            continue
        tech = {k: r.config.get(k, False) for k in ("compile", "fp8", "async_tp")}
        pick = choose_plan(src, devices=r.devices, cluster=r.cluster, global_batch=r.batch, seq=r.seq, **tech).best
        spec_of_dimensions(pick.parallel)  # parallelize builds it
        assert pick.cost.memory_bytes <= PRESETS[r.cluster].memory_bytes
        assert pick.tokens_per_s_per_gpu >= pub.tokens_per_s_per_gpu * (1 - 1e-9), (r.name, pick, pub)
        beaten.append(r.name)
    assert len(beaten) >= 26 and sorted(left) == sorted(
        [r.name for r in ROWS if r.source == "mlm-h100" and r.model in ("megatron-gpt-314b", "megatron-gpt-462b")]
        + ["A100 Llama 2 13B FSDP 64, no AC"]
        + [r.name for r in CP_ROWS if r.model == "llama3-405b" and r.config["cp"] > 1]), (beaten, left)


def test_tp_layouts_stay_inside_what_divides():
    assert tp_layouts(16, 8, 8, 8) == [(1,), (2,), (4,), (8,), (2, 2), (2, 4), (2, 8), (4, 4)]
    assert (8,) not in tp_layouts(16, 8, 12, 4)  # 12 heads: 1D over 8 would split a head
    assert (16,) not in tp_layouts(64, 8, 32, 8)  # 1D never crosses the node


def test_published_runs_within_the_issues_bounds():
    """Every published, measured run the issue lists (torchtitan's Llama 3 H100 and A100 tables) estimated
    in its own configuration: throughput within 0.8-1.25x of the measurement, memory within 0.85-1.2x where
    the source gives it. The measurements are the sources' (autopar.bench.published cites each). Megatron-LM's
    H100 table, which the issue does not list, is reported by `bench --published` and not held to the
    bounds here: its configurations' schedule and recomputation are assumed (see the module's sources)."""
    from autopar.bench.published import ROWS, run_rows

    for res in run_rows([r for r in ROWS if r.source.startswith("tt-")], progress=False):
        assert 0.8 <= res.speed_ratio <= 1.25, (res.row.name, res.speed_ratio)
        if res.memory_ratio is not None:
            assert 0.85 <= res.memory_ratio <= 1.2, (res.row.name, res.memory_ratio)


def test_context_parallel_runs_against_torchtitans_tables():
    """torchtitan's context-parallel runs (tables 2 and 6 of its Dec 2024 H100 benchmarks) estimated with
    `estimate(cp=...)`: memory within 0.85-1.2x of the measurement, and throughput falling with cp in the order
    measured. Throughput itself is not held to the 0.8-1.25x bounds: the estimate runs 1.02-1.51x fast, more so
    at cp 4 and 8 (docs/benchmarks.md, Context parallelism)."""
    from autopar.bench.published import CP_ROWS, run_rows

    results = run_rows(CP_ROWS, progress=False)
    for res in results:
        assert 0.85 <= res.memory_ratio <= 1.2, (res.row.name, res.memory_ratio)
    for source in ("tt-h100 table 2", "tt-h100 table 6"):
        rows = [res for res in results if res.row.source == source]
        measured = [res.row.tokens_per_s_per_gpu for res in rows]
        estimated = [res.estimate.tokens_per_s_per_gpu for res in rows]
        assert measured == sorted(measured, reverse=True) and estimated == sorted(estimated, reverse=True), \
            (source, measured, estimated)


def test_cp_attention_prices_the_flavour_parallelize_runs():
    """Llama-3-8B on 8 H100, cp 8, 65,536 tokens: its 32 query and 8 KV heads divide by 8, so 'auto' prices the
    all-to-all flavour parallelize runs (4 exchanges of (cp-1)/cp of q, k, v and the output each way), which moves
    fewer bytes here than the all-gather of K and V ((cp-1) x both); cp_attention is checked by name."""
    from autopar.planning.architectures import published_model

    src = load_model_source(published_model("llama3-8b", {}))
    est = {a: estimate(src, devices=8, cluster="dgx-h100", global_batch=1, seq=65536, dp_shard=1, cp=8,
                       recompute="full", cp_attention=a) for a in ("auto", "alltoall", "allgather", "ring")}
    assert est["auto"].parallel.cp_attention == "alltoall"
    comm = {a: sum(e.cost.comm_s.values()) for a, e in est.items()}
    assert comm["auto"] == comm["alltoall"] < comm["allgather"], comm
    with pytest.raises(UsageError, match="cp_attention='rings': expected 'auto' or one of"):
        estimate(src, devices=8, cluster="dgx-h100", global_batch=1, seq=65536, dp_shard=1, cp=8, cp_attention="rings")
    # 2D 1x8 leaves each rank 4 query and one KV head: no all-to-all over cp 2 ('auto' is the ring)
    with pytest.raises(UsageError, match="cp_attention='alltoall': the all-to-all flavour splits the heads"):
        estimate(src, devices=16, cluster="dgx-h100", global_batch=1, seq=65536, dp_shard=1, cp=2, tp=(1, 8),
                 cp_attention="alltoall")
    assert estimate(src, devices=16, cluster="dgx-h100", global_batch=1, seq=65536, dp_shard=1, cp=2, tp=(1, 8),
                    recompute="full").parallel.cp_attention == "ring"


def test_choose_plan_picks_context_parallel_for_long_sequences_only():
    """Llama-3-8B on 8 H100 (dgx-h100), 131,072 tokens per step: at 8,192 tokens per sequence the plan splits
    weights and batch (no cp); at 65,536 it splits each sequence over context-parallel ranks (4, beside 2 sharded
    replicas: torchtitan's FSDP 2 x CP 4 layout), and its parallelize keywords build that (grid=(dp, R, C),
    context_parallel=cp, context_attention as priced, the blocks sharded over all the replicas)."""
    from autopar.planning.architectures import published_model

    src = load_model_source(published_model("llama3-8b", {}))
    short = choose_plan(src, devices=8, cluster="dgx-h100", global_batch=16, seq=8192).best.parallel
    long = choose_plan(src, devices=8, cluster="dgx-h100", global_batch=2, seq=65536)
    assert short.cp == 1, short.describe()
    p = long.best.parallel
    assert p.cp > 1, p.describe()
    kw = long.kwargs
    assert (kw["context_parallel"], kw["context_attention"], kw["data_parallel"]) == (p.cp, p.cp_attention, "shard")
    assert math.prod(kw["grid"]) * p.cp == 8 and (kw["grid"][0] if len(kw["grid"]) == 3 else 1) == p.dp_shard, kw


def test_cli_estimate_json(capsys, tmp_path):
    import json

    from autopar.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
                               "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": LAYERS,
                               "vocab_size": VOCAB}))
    assert main(["estimate", str(cfg), "--devices", "8", "--batch", "2", "--seq", "32", "--tp", "2,2",
                 "--dp-shard", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"step_s", "tokens_per_s_per_gpu", "mfu", "memory_gib_per_rank"} <= set(out)
    assert out["batch"] == 4 and out["parallel"]["tp"] == [2, 2]
    assert main(["estimate", str(cfg), "--devices", "8", "--batch", "2", "--seq", "32", "--tp", "16"]) == 2
    assert "autopar estimate: tp=16 does not divide the model's 8 attention heads" in capsys.readouterr().err
    assert main(["plan", str(cfg), "--devices", "8", "--global-batch", "16", "--seq", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["tokens_per_s_per_gpu"] >= max(e["tokens_per_s_per_gpu"] for e in out["next"])
    assert math.prod(out["parallelize"]["grid"]) * out["best"]["parallel"]["pp"] == 8
    # --dry-run: the configuration's program, each simulated rank's bytes, calls and memory, the checks' verdict
    # (--workers 1: the simulated ranks in this process, one after the other)
    assert main(["estimate", str(cfg), "--devices", "8", "--batch", "2", "--seq", "32", "--tp", "2",
                 "--dp-shard", "2", "--pp", "2", "--json", "--dry-run", "--workers", "1"]) == 0
    d = json.loads(capsys.readouterr().out)["dry_run"]
    assert d["world"] == 8 and d["ranks"] == 2 and d["verdict"].startswith("cross-rank checks passed")
    assert all({"bytes", "calls", "peak_memory_bytes"} <= set(r) for r in d["per_rank"].values())
    assert {r["at"][0] for r in d["per_rank"].values()} == {0, 1}  # both stages


def test_a_calibration_file_is_a_cluster(tmp_path):
    """`autopar calibrate`'s JSON prices a step on the machines it measured: one node of R*C ranks, the
    slower axis's link, the measured rates reached in full, nothing hidden behind compute; its per-op
    floor adds op_s per graph op; a collective's cost inside a step is the one measured for its group's
    size (4 ranks on 2 cores: several times that of 2)."""
    from passes.cost.cluster import resolve_cluster
    from passes.cost.model import save

    cal = {"version": 1, "source": "calibrate", "grid": [2, 2], "backend": "gloo", "device": "cpu",
           "axes": [{"alpha_s": 1e-3, "beta_bytes_per_s": 5e9, "points": []},
                    {"alpha_s": 2e-3, "beta_bytes_per_s": 2e9, "points": []}],
           "flops_per_s": 8e10, "when": "2026-12-06T00:00:00+00:00", "memory_bytes_per_s": 2e10, "op_s": 0.0}
    path = tmp_path / "cal.json"
    save(cal, path)
    cl = resolve_cluster(str(path))
    assert cl.gpus_per_node == 4 and cl.intra.alpha_s == 2e-3 and cl.intra.beta_bytes_per_s == 2e9
    assert cl.matmul_efficiency == 1.0 and cl.overlap_cost == 1.0 and cl.peak_flops == 8e10
    src = tiny()
    base = estimate(src, devices=4, cluster=str(path), seq=32, global_batch=4, tp=4, precision="fp32")
    save({**cal, "op_s": 1e-5}, path)
    floor = estimate(src, devices=4, cluster=str(path), seq=32, global_batch=4, tp=4, precision="fp32")
    ops = LAYERS * model_profile(src, 32)[0].block.ops + model_profile(src, 32)[0].outer.ops
    assert floor.step_s - base.step_s == pytest.approx(ops * 1e-5, rel=1e-6)
    save({**cal, "in_step_alpha_s": {"2": 5e-4, "4": 4e-3}}, path)  # measured inside a step, per group size
    cl = resolve_cluster(str(path))
    assert cl.group_link(4, 4).alpha_s == 4e-3 and cl.group_link(4, 2).alpha_s == 5e-4
    assert cl.group_link(4, 4).beta_bytes_per_s == 2e9


def test_overlap_false_prices_2d_transfers_in_line():
    """Catches an estimate that ignores `overlap` (parallelize(overlap=False) waits for every SUMMA
    panel, so its step cannot be priced as overlapped), or one that lets it change 1D, which the option
    does not touch: the same 2x2 step costs more with overlap=False, by at most its TP communication,
    and the 1D step is the same either way."""
    src = tiny()
    on, off = (estimate(src, devices=4, cluster="dgx-h100", seq=32, global_batch=8, tp=(2, 2), overlap=v)
               for v in (True, False))
    assert off.cost.step_s > on.cost.step_s, (on.cost.step_s, off.cost.step_s)
    assert off.cost.step_s - on.cost.step_s <= sum(off.cost.comm_s.values()) * (1 + 1e-9), (on.cost, off.cost)
    one = [estimate(src, devices=2, cluster="dgx-h100", seq=32, global_batch=8, tp=2, overlap=v).cost.step_s
           for v in (True, False)]
    assert one[0] == one[1], one
