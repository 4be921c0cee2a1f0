"""The dry run (`autopar.dry_run`): every simulated rank's program built and stepped under the fake
process group in this one process; its collectives checked across ranks and its bytes against the
plan at its own position. Structure only (values are meaningless under the fake group): the parity
of the same programs is tested on real gloo ranks elsewhere."""

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.parallel.dry_run import DryRunError, covering_ranks
from models import GPTConfig, TinyGPT


def _gpt(hidden=32, heads=4):
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1, hidden=hidden, heads=heads, vocab_size=64)
    ids = torch.randint(0, cfg.vocab_size, (8, 8), generator=torch.Generator().manual_seed(1))
    return TinyGPT(cfg), (ids, ids.roll(1, 1))


def _dry(model, inputs, grid, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.dry_run(model, grid=grid, example_inputs=inputs, **options)


@pytest.mark.parametrize("grid, options, hidden", [((8, 8), {}, 64), ((1, 64), dict(strategy="1d"), 64),
                                                   ((4, 4, 4), dict(strategy="3d"), 64),
                                                   ((2, 2, 2), dict(data_parallel="shard"), 32),
                                                   ((2, 4), dict(strategy="auto"), 32)],
                         ids=["2d-8x8", "1d-1x64", "3d-4x4x4", "shard-2x2x2", "auto-2x4"])
def test_every_position_builds_and_its_bytes_are_the_plan(grid, options, hidden):
    """Catches a program whose collectives differ between members of a group, and a plan that prices
    other bytes than a rank's step moves, at scales no test here can run on processes: 64 ranks of an
    8x8 grid, 1D over 64 (64 ranks simulated: most hold none of the 8 position rows), a 4x4x4 cube,
    sharded replicas, and strategy='auto' (rank 0's choice, sent as an object, handed to the ranks
    simulated after it). The ranks that cover every row, column and
    replica index are simulated; every one's grid bytes equal its plan's exactly, with real tensors
    and on fake ones alike (the same collectives in the same order)."""
    model, inputs = _gpt(hidden, heads=4 if hidden == 32 else 8)
    report = _dry(model, inputs, grid, fake=False, **options)
    fake = _dry(model, inputs, grid, fake=True, **options)  # the repo's GPT ties its head: one fake weight
    assert sorted(report.ranks) == covering_ranks(grid, cube=options.get("strategy") == "3d"), sorted(report.ranks)
    for rank, run in report.ranks.items():
        assert run.step and run.counted["grid"] > 0, (rank, run)
        assert run.counted["grid"] == run.planned, (rank, run.counted, run.planned)
        twin = fake.ranks[rank]  # fake tensors: the same collectives, in the same order, the same bytes
        assert [c.key() for c in twin.step] == [c.key() for c in run.step] and twin.counted == run.counted, rank
    if options.get("data_parallel") == "shard":  # FSDP2 over the replicas: counted under their own kind
        assert all(run.counted["replicas"] > 0 for run in report.ranks.values())


def test_covering_ranks_cover_every_index():
    """The default set: each stage, replica, row and column index at least once, in as few ranks as the
    longest axis; 'groups': a cross through the origin on the first and last stage (one replica group, one
    row and one column whole) and the origin on every stage (one pipeline chain whole)."""
    for grid, stages in (((8, 8), 1), ((2, 4), 1), ((2, 2, 4), 1), ((1, 64), 1), ((4, 4, 4), 8), ((2, 1, 2), 2)):
        shape = (stages, *((1, *grid) if len(grid) == 2 else grid))
        ranks = covering_ranks(grid, stages)
        assert len(ranks) == max(shape), (grid, ranks)
        S, d, R, C = shape
        for axis, n, seen in ((0, S, {k // (d * R * C) for k in ranks}), (1, d, {k // (R * C) % d for k in ranks}),
                              (2, R, {k // C % R for k in ranks}), (3, C, {k % C for k in ranks})):
            assert seen == set(range(n)), (grid, axis, ranks)
    assert covering_ranks((2, 2, 2), cube=True) == [0, 2, 5, 7]  # a cube's ranks sit on its (2, 4) grid
    # 4 stages of 2x2x2: the cross {000, 100, 010, 001} on stages 0 and 3, the origin on stages 1 and 2
    assert covering_ranks((2, 2, 2), 4, groups=True) == [0, 1, 2, 4, 8, 16, 24, 25, 26, 28]


class _RankBranch(nn.Module):
    """A model whose rank 1 runs one more linear than the others: its collectives differ from its row's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        import torch.distributed as dist

        h = self.a(x)
        if dist.get_rank() == 1:
            h = self.b(h)
        return h


def test_a_rank_dependent_program_is_caught():
    """Catches the bug that hangs NCCL: rank 1 issues collectives its group's other member does not (here
    already while parallelize places the weight only its program reads). The error names both ranks,
    the group, the position and what each issued."""
    torch.manual_seed(0)
    with pytest.raises(DryRunError, match=r"ranks 0 and 1 of group \[0, 1\] issue different collectives at "
                                          r"position \d+ of the (setup|step): rank 0 .*; rank 1 "):
        _dry(_RankBranch(), (torch.randn(4, 16),), (2, 2), ranks=[0, 1, 2, 3])
    report = _dry(_RankBranch(), (torch.randn(4, 16),), (2, 2), ranks=[0, 2], check=False)  # one column: agrees
    report.check()


class _RankTwice(nn.Module):
    """A model whose rank 1 runs its one linear twice: the same weights everywhere, another step."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        import torch.distributed as dist

        h = self.a(x)
        if dist.get_rank() == 1:
            h = self.a(h)  # the line the dry run names
        return h


def test_a_rank_dependent_step_names_the_models_line():
    """The step's first differing collective names the line of the user's model it was issued for."""
    torch.manual_seed(0)
    with pytest.raises(DryRunError, match=r"of the step: .*rank 1 .*in the model at .*test_dry_run\.py.*"
                                          r"h = self\.a\(h\)"):
        _dry(_RankTwice(), (torch.randn(4, 16),), (1, 2), ranks=[0, 1])


@pytest.mark.parametrize("grid, stages", [((2, 1, 2), 2), ((4, 2, 2), 4)], ids=["pp2-shard2-1x2", "pp4-shard4-2x2"])
def test_pipeline_stages_over_sharded_replicas(grid, stages):
    """Catches a pipeline whose stages' collectives or point-to-point sends differ from what the plan and
    `p2p_traffic()` say: 2 stages x 2 sharded replicas x 1x2 (8 ranks) and 4 x 4 x 2x2 (64 ranks) of a
    Llama with a layer per stage, 1F1B; every stage, replica, row and column index simulated (a stage
    receives its layouts from a simulated rank of the one before, relayed). Every rank's grid bytes equal
    its stages' plans times the micro-batches, its sends `p2p_traffic()`; on fake tensors the same
    calls, in order, and bytes."""
    from tests.checks_pipeline import _llama

    model, make = _llama(stages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = autopar.dry_run(model, grid=grid, example_kwargs=make(16, 8, 1), pipeline=stages,
                                 data_parallel="shard")
        fake = autopar.dry_run(model, grid=grid, example_kwargs=make(16, 8, 1), pipeline=stages,
                               data_parallel="shard", fake=True)
    world = stages * grid[0] * grid[1] * grid[2]
    assert report.world == world and sorted(report.ranks) == covering_ranks(grid, stages), sorted(report.ranks)
    assert {run.at[0] for run in report.ranks.values()} == set(range(stages))
    for rank, run in report.ranks.items():
        assert run.counted["grid"] == run.planned > 0, (rank, run.counted, run.planned)
        assert run.counted["replicas"] > 0 and run.agrees, (rank, run.counted)
        assert (run.counted["pp"] > 0) and run.counted["pp"] == run.counted["pp_planned"], (rank, run.counted)
        twin = fake.ranks[rank]  # on fake tensors (the stages cut and run on them): the same calls and bytes
        assert [c.key() for c in twin.step] == [c.key() for c in run.step] and twin.counted == run.counted, rank


def test_dry_run_refusals():
    """Looped pipeline schedules on real tensors (one process), a bad grid, ranks outside the world: each
    named."""
    model, inputs = _gpt()
    with pytest.raises(autopar.UsageError, match="several stages per rank .* simulated with a forked process per "
                                                 "rank on fake tensors"):
        autopar.dry_run(model, grid=(1, 2), example_inputs=inputs, fake=False,
                        pipeline=autopar.Pipeline(stages=2, schedule="interleaved_1f1b", stages_per_rank=2))
    with pytest.raises(autopar.UsageError, match=r"grid=\(0, 2\): expected \(R, C\)"):
        autopar.dry_run(model, grid=(0, 2), example_inputs=inputs)
    with pytest.raises(autopar.UsageError, match=r"ranks=\[4\]: expected 'cover' .* ranks in \[0, 4\)"):
        autopar.dry_run(model, grid=(2, 2), example_inputs=inputs, ranks=[4])


def test_fake_tensors_issue_what_real_ones_do():
    """Catches a fake-tensor dry run that differs from the real program: the same Llama on 4x4, once
    with real tensors and once on fake ones (autopar's library ops running their eager bodies), issues
    the same collectives in the same order with the same shapes on every simulated rank, and counts the
    same bytes, equal to the plan. A model built on the meta device takes the fake path by default."""
    from autopar.checkpoint import restore_buffers
    from tests.checks_hf import build

    model, make = build("llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                        intermediate_size=128, num_hidden_layers=2, use_cache=False)
    kw = make(8, 16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = autopar.dry_run(model, grid=(4, 4), example_kwargs=kw, fake=False)
        fake = autopar.dry_run(model, grid=(4, 4), example_kwargs=kw, fake=True)
        with autopar.meta_init():
            on_meta, _ = build("llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                               intermediate_size=128, num_hidden_layers=2, use_cache=False)
        restore_buffers(on_meta)
        meta = autopar.dry_run(on_meta, grid=(4, 4), example_kwargs=kw)
    for rank, run in real.ranks.items():
        for other in (fake, meta):
            twin = other.ranks[rank]
            assert [c.key() for c in twin.step] == [c.key() for c in run.step], rank
            assert twin.counted == run.counted and twin.planned == run.planned == run.counted["grid"], rank


@pytest.mark.parametrize("grid, strategy", [((1, 8), "1d"), ((2, 4), "2d")])
def test_a_fused_weight_regroups_in_one_all_to_all(grid, strategy):
    """GPT-2's fused c_attn stored as plain blocks (fused='regroup', the default) is read interleaved
    (block c of q, of k and of v): one all-to-all of the chunks other members hold for the weight and
    one for the bias, forward and (inverse) backward, instead of an all-gather of each. Which chunks a
    column receives depends on its index (of 8 columns, member 1 holds none of its own 3, members 0 and
    2 one each): every column's counted bytes equal its plan at its own position, on real and on fake
    tensors; under 1D each column moves at most 3 chunks of 1/(3t) of the weight and bias each way
    more than the interleaved layout (which regroups nothing). It moved an all-gather of the whole
    weight each way (2.5x Megatron-SP's bytes for a block of hidden 1,024 with one sequence of 512 at
    1 x 8; now 1.14x)."""
    from tests.checks_hf import build

    model, make = build("gpt2", n_embd=96, n_head=8, n_layer=1)
    kw = make(1, 32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = autopar.dry_run(model, grid=grid, example_kwargs=kw, strategy=strategy, fake=False)
        fake = autopar.dry_run(model, grid=grid, example_kwargs=kw, strategy=strategy, fake=True)
        gathered = autopar.plan(model, grid=grid, example_kwargs=kw, strategy=strategy, fused="interleave")
    counted = []
    for rank, run in real.ranks.items():
        assert run.counted["grid"] == run.planned, (rank, run.counted, run.planned)
        twin = fake.ranks[rank]
        assert [c.key() for c in twin.step] == [c.key() for c in run.step] and twin.counted == run.counted, rank
        a2a = [c for c in run.step if c.op == "all_to_all_single"]
        assert len(a2a) == 4, (rank, [c.op for c in run.step])  # c_attn's weight and bias, forward and backward
        counted.append(run.counted["grid"])
    assert len(set(counted)) > 1 or grid[1] == 4, counted  # 8 columns: rank-dependent chunks
    if strategy == "1d":
        t, h = grid[1], 96
        weight = (h + 1) * 3 * h * 4  # and bias; each way a column receives at most 3 chunks of 1/(3t) of them
        assert max(counted) - gathered.comm_bytes_per_rank_per_step <= 2 * 3 * weight // (3 * t), counted


def test_an_order_across_groups_that_waits_for_ever_is_caught():
    """Catches the hang no single group shows: ranks 0 and 1 share groups A = [0, 1] and B = [0, 1, 2, 3]
    and each group's calls agree in kind, but rank 0 issues A's before B's and rank 1 B's before A's, so
    each waits for the other for ever. (Recorded sequences built by hand: autopar's own programs
    issue one order; the dry run of each of its layouts above passes this check.)"""
    from autopar.parallel.dry_run import Collective, DryRun, RankRun

    def call(group):
        return Collective("allreduce", group, ((4,),), "torch.float32", None, "test")

    a, b = (0, 1), (0, 1, 2, 3)
    ranks = {0: RankRun(0, (0, 0, 0), step=[call(a), call(b)]), 1: RankRun(1, (0, 0, 1), step=[call(b), call(a)])}
    with pytest.raises(DryRunError, match=r"wait on one another for ever: call 0 of group \[0, 1\] before call 0 "
                                          r"of group \[0, 1, 2, 3\] \(rank 0\); call 0 of group \[0, 1, 2, 3\] before "
                                          r"call 0 of group \[0, 1\] \(rank 1\)"):
        DryRun(4, (2, 2), ranks).check()
    ranks[1] = RankRun(1, (0, 0, 1), step=[call(a), call(b)])
    DryRun(4, (2, 2), ranks).check()  # one order: no hang


def test_a_pipelines_fsdp_units_gather_once_per_step():
    """Catches FSDP2 inside a pipeline gathering its stage's parameters and reduce-scattering its gradients
    once per micro-batch (64 micro-batches: 64 times the bytes): with reshard_after_forward=False a step
    of 2 micro-batches and one of 4 move the same FSDP2 bytes, in as many calls, on every rank."""
    from tests.checks_pipeline import _llama

    model, make = _llama(2)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (2, 4):
            runs[m] = autopar.dry_run(model, grid=(2, 1, 2), example_kwargs=make(8, 8, 1), fake=True, ranks=[0],
                                      pipeline=autopar.Pipeline(stages=2, microbatches=m), data_parallel="shard",
                                      reshard_after_forward=False)
    for rank, run in runs[2].ranks.items():
        twin = runs[4].ranks[rank]
        fsdp = [[c for c in r.step if c.where.startswith("sharded.py")] for r in (run, twin)]  # FSDP2's calls
        assert fsdp[0] and len(fsdp[0]) == len(fsdp[1]), (rank, len(fsdp[0]), len(fsdp[1]))
        assert run.tags["fsdp:all-gather"] == twin.tags["fsdp:all-gather"] > 0, rank
        assert run.tags["fsdp:reduce-scatter"] == twin.tags["fsdp:reduce-scatter"] > 0, rank


def test_workers_side_by_side_record_what_one_process_does():
    """Catches a rank simulated in a forked worker that misses an object a lower rank sent it (a stage's
    strategy choice, its output layouts for the next stage) or records other calls: 2 stages x 2 sharded
    replicas x 1x2 of a Llama, strategy='auto', every rank of the default set, on 3 workers and in this
    one process: the same setup and step calls (op, group, shapes, dtype, root, autopar's line), the same
    bytes counted and planned, the same memory held, on every rank."""
    from tests.checks_pipeline import _llama

    model, make = _llama(2)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for workers in (1, 3):
            runs[workers] = autopar.dry_run(model, grid=(2, 1, 2), example_kwargs=make(8, 8, 1), fake=True,
                                            pipeline=2, data_parallel="shard", strategy="auto", workers=workers)
    # the default set (0, 7), and the ranks that send the stages' strategy choices on to it: each stage's first
    # rank (0, 4) and the first rank of rank 7's replica (6)
    assert sorted(runs[3].ranks) == sorted(runs[1].ranks) == [0, 4, 6, 7] == sorted({*covering_ranks((2, 1, 2), 2),
                                                                                    4, 6})
    for rank, run in runs[1].ranks.items():
        twin = runs[3].ranks[rank]
        assert twin.setup == run.setup and twin.step == run.step, rank
        assert (twin.counted, twin.planned, twin.held, twin.tags) == (run.counted, run.planned, run.held, run.tags)


class _FailsOnRankOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("rank 1 cannot build this model")
        return self.a(x)


def test_a_workers_failure_reaches_the_caller():
    """An error raised while a forked worker simulates its rank (here the capture's, of a model that fails on
    rank 1) is raised by `dry_run` itself, as the same exception, with a note naming the rank and carrying
    the worker's traceback; workers=0 is refused."""
    with pytest.raises(autopar.CaptureError, match="rank 1 cannot build this model") as info:
        _dry(_FailsOnRankOne(), (torch.randn(4, 16),), (1, 2), ranks=[0, 1], fake=True, workers=2)
    assert any("worker process simulating rank 1" in note for note in getattr(info.value, "__notes__", [])), info
    with pytest.raises(autopar.UsageError, match=r"workers=0: expected a positive int"):
        _dry(_FailsOnRankOne(), (torch.randn(4, 16),), (1, 2), workers=0)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b"])
def test_a_looped_schedule_builds_each_rank_from_what_a_later_rank_sends(schedule):
    """Catches a looped schedule's dry run that cannot build a rank's later stage (its layouts come from a
    rank simulated after it) or whose program moves other bytes than its plan: 2 stages per rank over 2
    pipeline ranks of a 4-block Llama at 1x2, the default ranks (one process each): checks pass, each
    rank's grid bytes equal its two stages' plans times the micro-batches, its sends `p2p_traffic()`."""
    from tests.checks_pipeline import _llama

    model, make = _llama(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = autopar.dry_run(model, grid=(1, 2), example_kwargs=make(8, 8, 1), fake=True,
                                 pipeline=autopar.Pipeline(stages=2, schedule=schedule, stages_per_rank=2))
    assert sorted(report.ranks) == [0, 3]  # rank 0's stage 2 is built from what rank 3 (stage 1) sends it
    for rank, run in report.ranks.items():
        assert run.counted["grid"] == run.planned > 0, (rank, run.counted, run.planned)
        assert run.counted["pp"] == run.counted["pp_planned"] > 0, (rank, run.counted)


class _TypeTable(nn.Module):
    """A 2-row table (a token-type embedding) beside a 64-row one: at 1x4 in 1D, ranks 2 and 3 hold no row."""

    def __init__(self):
        super().__init__()
        self.tok, self.typ = nn.Embedding(64, 64), nn.Embedding(2, 64)
        self.lin, self.head = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, ids, types):
        return self.head(torch.relu(self.lin(self.tok(ids) + self.typ(types))))


def test_ranks_simulated_in_one_process_keep_their_own_meshes():
    """Catches a rank simulated after another in one process taking the earlier rank's DeviceMesh: DTensor's
    sharding-propagation caches key meshes by ranks and shape, not by this process's place in them, so rank 2's
    2-row table came back on rank 0's mesh (coordinate (0, 0)) and its backward failed ([0, 64] into [1, 64]),
    where 4 gloo ranks pass. Every rank of 1x4 1D, one process: its step runs, and its grid bytes equal its
    plan's, on real and fake tensors."""
    torch.manual_seed(0)
    ids, types = torch.randint(0, 64, (4, 16)), torch.randint(0, 2, (4, 16))
    for fake in (False, True):
        report = _dry(_TypeTable(), (ids, types), (1, 4), strategy="1d", ranks="all", workers=1, fake=fake)
        assert sorted(report.ranks) == [0, 1, 2, 3]
        for rank, run in report.ranks.items():
            assert run.counted["grid"] == run.planned > 0, (fake, rank, run.counted, run.planned)


def test_context_parallel_at_64_ranks_moves_what_it_prices():
    """context_parallel=4 beside a 2x4 grid and 2 data-parallel replicas (grid=(2, 2, 4): 64 ranks, one process,
    fake tensors): the covering ranks are built, their grid bytes are the plan's, and each one's context-parallel
    bytes are `passes.cost.context`'s price: 8 heads over 4 columns leave 2 per rank, which 4 does not divide, so
    the ring flavour (3 K/V blocks per attention forward, 3 and 4 gradient blocks backward, each a point-to-point
    transfer the fake group records, inside its batch's cp group), plus the logits' gather and the loss's sum."""
    from passes.cost.context import loss_bytes, output_bytes, ring_bytes

    model, (ids, tgt) = _gpt(64, heads=8)
    seq, cp = ids.shape[1] * 8, 4
    ids, tgt = ids.repeat(1, 8), tgt.repeat(1, 8)
    report = autopar.dry_run(model, (2, 2, 4), example_inputs=(ids, tgt), context_parallel=cp, fake=True)
    assert sorted(report.ranks) == covering_ranks((2 * cp, 2, 4)), sorted(report.ranks)
    b, n, d = ids.shape[0] // 2, seq // cp, 64 // 8
    fwd, bwd = ring_bytes(b * (8 // 4) * n * d * 4, cp)
    layers = model.cfg.layers
    want = layers * (fwd + bwd) + output_bytes(b * n * -(-model.cfg.vocab_size // 4) * 4, cp) + loss_bytes(4, cp)
    for rank, run in report.ranks.items():
        assert run.counted["grid"] == run.planned, (rank, run.counted, run.planned)
        assert run.counted["context"] == want, (rank, run.counted["context"], want)
