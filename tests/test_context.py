"""Context parallelism (`parallelize(..., context_parallel=cp)`): parity with the unmodified model on one process,
every rank, every element, forward, gradients and AdamW steps; the bytes each rank receives as priced; checkpoints
across cp degrees; refusals by name."""

import pytest

from tests import checks_context as C
from tests.compare import assert_every_rank
from tests.conftest import get_pool


def _check(results, what, flavour: str | None = None):
    assert_every_rank([r["excess"] for r in results], what)
    for rank, r in enumerate(results):
        if "bytes" in r:
            assert r["bytes"] == r["expected"], f"{what}: rank {rank}: context bytes {r['bytes']} != {r['expected']}"
        if flavour is not None:
            assert r["flavours"] == [flavour], f"{what}: rank {rank}: attentions ran {r['flavours']}, not {flavour}"
            assert len(r["explain"]) == 1 and f" {flavour})" in r["explain"][0], (what, rank, r["explain"])


@pytest.mark.parametrize("attention,runs", [("auto", "alltoall"), ("ring", "ring"), ("allgather", "allgather")])
def test_cp4_alone_gpt(pool4, attention, runs):
    """Catches a token at the wrong global position (learned positions), a causal mask that is not causal by
    global position (the zig-zag halves), a wrong share of the targets when a rank's chunks count none of them
    (row 1's padded tail), a gradient of K or V not summed back over the ranks, or outputs gathered out of order:
    cp 4 on a 1x1 grid, every rank, in each attention flavour (the ring: K/V blocks and their gradients' sums
    passed around four ranks, the causal blocks each rank skips)."""
    _check(pool4.run(C.parity, "gpt", (1, 1), 4, context_attention=attention), f"TinyGPT cp 4 {attention}", runs)


def test_cp2_with_a_1x2_grid_llama(pool4):
    """transformers' Llama (RoPE from position ids, its causal mask built in the graph, its labels shifted in the
    loss, grouped-query KV heads repeated) at cp 2 beside 1D-width 1x2 tensor parallel (2D SUMMA on 1x2): one KV
    head per rank, which cp 2 cannot split, so 'auto' runs the ring with the KV heads unrepeated."""
    _check(pool4.run(C.parity, "llama", (1, 2), 2), "Llama cp 2 x 1x2", "ring")


@pytest.mark.parametrize("attention,runs", [("auto", "alltoall"), ("ring", "ring")])
def test_cp4_unmasked_attention_and_the_users_loss(pool4, attention, runs):
    """Bidirectional attention (no mask: every ring block whole) and a loss the caller computes on the gathered
    output."""
    _check(pool4.run(C.parity, "encoder", (1, 1), 4, context_attention=attention), f"encoder cp 4 {attention}", runs)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "neox"])
def test_cp2_families(pool4, family):
    """The other causal-LM families the issue names, cp 2 x 1x2."""
    _check(pool4.run(C.parity, family, (1, 2), 2), f"{family} cp 2 x 1x2")


def test_cp2_with_a_2x2_grid():
    """cp 2 beside a 2x2 SUMMA grid (8 ranks), Llama and TinyGPT."""
    pool = get_pool(8)
    _check(pool.run(C.parity, "llama", (2, 2), 2), "Llama cp 2 x 2x2")
    _check(pool.run(C.parity, "gpt", (2, 2), 2, batch=4), "TinyGPT cp 2 x 2x2")


def test_a_cp2_checkpoint_loads_on_one_process(pool4):
    """save_pretrained after two steps at cp 2 x 1x2: transformers loads the whole model (any cp degree reads it)."""
    path = pool4.run(C.tmp_dir)[0]
    _check(pool4.run(C.saved, "llama", (1, 2), 2, path), "Llama cp 2 checkpoint")


def test_what_context_parallelism_refuses(pool4):
    """A length not divisible by 2 cp, a padding mask, a sliding window, data_parallel='auto', a wrong world size
    (with and without replicas), a shift over the tokens inside the model, a running sum over them, attention
    written as matmul and softmax, a mask given as an input and a batch of each rank's own: each a UsageError."""
    for r in pool4.run(C.refusals):
        assert len(r) == 11, sorted(r)


def test_generation_with_context_parallel(pool4):
    """pmodel.generate at cp 2 x 1x2: greedy tokens equal transformers' generate on one process, every rank."""
    for rank, r in enumerate(pool4.run(C.generated)):
        assert r["same"], (rank, r["got"], r["want"])


@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
def test_cp2_beside_data_parallel_replicas(pool4, data_parallel):
    """grid=(2, 1, 1) with context_parallel=2 (4 ranks): two batches, each split over its own two cp ranks (the
    ring: TinyGPT's 4 heads over cp 2 would take the all-to-all, so the ring is asked for); gradients averaged over
    all four (the mean of the two batches' losses, one with a padded row), replicated or sharded over the four
    (torchtitan's FSDP x CP); the cp collectives inside each batch's own group."""
    _check(pool4.run(C.parity, "gpt", (2, 1, 1), 2, context_attention="ring", data_parallel=data_parallel),
           f"TinyGPT dp 2 x cp 2, {data_parallel}", "ring")


def test_cp2_with_strategy_auto(pool4):
    """strategy='auto' on the 1x2 grid (rank 0's search, sent to every rank, the cp ranks included)."""
    _check(pool4.run(C.parity, "gpt", (1, 2), 2, strategy="auto"), "TinyGPT cp 2 x 1x2, strategy='auto'")


def test_cp2_with_1d_and_recompute(pool4):
    """cp 2 beside Megatron-style 1D tensor parallelism on 1x2, each block recomputed in backward (its
    all-to-alls run again)."""
    _check(pool4.run(C.parity, "gpt", (1, 2), 2, strategy="1d", recompute="blocks", expect_recompute=True),
           "TinyGPT cp 2 x 1D 1x2, recompute='blocks'")


def test_cp2_with_sharded_blocks_llama(pool4):
    """data_parallel='shard': FSDP2 splits the grid's blocks over the cp ranks (torchtitan's FSDP x CP layout),
    gathering them per block; the same parity, AdamW's states sharded."""
    _check(pool4.run(C.parity, "llama", (1, 2), 2, data_parallel="shard"), "Llama cp 2 x 1x2, sharded")


@pytest.mark.parametrize("attention,runs", [("auto", "alltoall"), ("ring", "ring")])
def test_cp4_compiled(pool4, attention, runs):
    """compile=True: each rank's program under torch.compile, the context collectives between its regions."""
    _check(pool4.run(C.parity, "gpt", (1, 1), 4, compile=True, context_attention=attention),
           f"TinyGPT cp 4 compiled {attention}", runs)


def test_a_distributed_checkpoint_loads_across_cp_degrees(pool4):
    """torch.distributed.checkpoint saved at cp 2 x 1x2 loads at cp 4 (blocks sharded over the cp ranks) and at
    cp 1 x 2x2, bit for bit."""
    path = pool4.run(C.tmp_dir)[0]
    _check(pool4.run(C.dcp_across, path + "/dcp"), "DCP across cp degrees")
