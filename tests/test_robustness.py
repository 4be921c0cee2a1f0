"""Never wrong, never hung: error texts, ranks that disagree, a rank that dies, an interrupted save."""



from tests.dist_pool import spawn_fresh
from tests import checks_robust as C


def test_bad_input_messages(pool4):
    res = pool4.run(C.bad_inputs)
    r0 = res[0]
    kind, msg = r0["zero grid"]
    assert kind == "UsageError" and "grid=(0, 0): expected (R, C) of positive ints" in msg
    kind, msg = r0["structure"]
    assert kind == "SignatureError" and "captured with 2 positional input(s)" in msg and "called with 1" in msg
    kind, msg = r0["device"]
    assert kind == "UsageError" and "is on meta" in msg and "blocks are on cpu" in msg
    kind, msg = r0["dtype"]
    assert kind == "UsageError" and "input 0 is torch.float64" in msg and "parallelized with torch.float32" in msg
    kind, msg = r0["strict unsupported"]
    assert kind == "ShardingError" and "on_unsupported='error'" in msg
    assert "aten.cumprod" in msg and "test_robustness" not in msg and "checks_robust.py" in msg
    for rank, r in enumerate(res):  # every rank raises, none hangs
        kind, msg = r["plans differ"]
        assert kind == "UsageError" and "ranks built different plans: rank 1 differs from rank 0" in msg, (rank, r)
        kind, msg = r["inputs differ"]
        assert kind == "UsageError" and "positional input 0 differs between the ranks of this grid" in msg, (rank, r)
        # another model on one rank (vocab 66, an MLP of hidden 64) passed the handshake, then aborted in gloo
        for case, words in (("model differs", "rank 1 differs from rank 0"), ("mlp differs", "rank 2 differs")):
            kind, msg = r[case]
            assert kind == "UsageError" and "ranks built different plans" in msg and words in msg, (rank, case, msg)
        kind, msg = r["state differs"]  # loaded a patchwork of the ranks' values
        assert kind == "UsageError" and "'blocks.0.mlp.up.weight' differs between ranks" in msg \
            and "ranks [3]" in msg, (rank, msg)
        kind, msg = r["batch differs"]  # aborted two processes in gloo
        assert kind == "UsageError" and "1: ((8, 8)" in msg \
            and "positional input 0 has shape and dtype ((4, 8), 'torch.int64') on rank 0" in msg, (rank, msg)
        assert r["after batch differs"] == (None, ""), (rank, r["after batch differs"])
        kind, msg = r["nested"]
        assert kind == "UsageError" and "this model is already parallelized" in msg, (rank, r["nested"])
        kind, msg = r["nested inside"]
        assert kind == "UsageError" and "submodule '0' of this model is already parallelized" in msg, (rank, msg)


def _spawn(fn, world, tmp_path):
    return spawn_fresh(fn, world, str(tmp_path))


def test_dying_rank_raises_on_the_others(tmp_path):
    """Rank 3 exits before a step: ranks 0-2 raise a CollectiveError naming the collective instead of
    waiting forever (the test itself fails after 120 s if anything hangs)."""
    hung = _spawn(C.dying_rank, 4, tmp_path).join(timeout=120)
    assert not hung, f"a surviving rank hung: {hung}"
    for rank in range(3):
        kind, msg = open(tmp_path / f"rank{rank}.txt").read().split("\n", 1)
        assert kind == "CollectiveError", (rank, kind, msg)
        assert "failed on rank" in msg and "A peer rank has probably exited" in msg


def test_stalled_sharded_replica_raises_a_collective_error(tmp_path):
    """Catches FSDP2's own collectives failing with the backend's raw error (issue 50, item 7: gloo's
    'Timed out waiting 15000ms for send' where the grid's collectives name theirs): a sharded replica's
    peer that stops calling the model makes its FSDP2 all-gather raise a CollectiveError naming the
    collective, the replica axis and the rank, after the timeout given to parallelize (5 s)."""
    hung = _spawn(C.stalled_fsdp_peer, 2, tmp_path).join(timeout=120)
    assert not hung, f"a rank hung: {hung}"
    kind, seconds, msg = open(tmp_path / "rank0.txt").read().split("\n", 2)
    assert kind == "CollectiveError", (kind, msg)
    assert "FSDP2 all-gather of a unit's parameter shards over mesh axis dp" in msg and "failed on rank 0" in msg, msg
    assert 4.0 <= float(seconds) <= 30.0, seconds


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    import torch
    import transformers

    procs = _spawn(C.interrupted_save, 1, tmp_path)
    procs[0].join(timeout=120)
    assert procs[0].exitcode == 9, "the save was supposed to be killed mid-way"
    path = tmp_path / "ckpt"
    model = transformers.GPT2LMHeadModel.from_pretrained(str(path))  # the previous, good checkpoint
    torch.manual_seed(0)
    from tests.checks_hf import build

    original, _ = build("gpt2")
    for (n, p), (_, q) in zip(model.named_parameters(), original.named_parameters()):
        assert torch.equal(p, q), n


def test_out_of_range_ids_and_targets_raise_on_every_rank(pool4):
    """An id >= vocab or -1, a sequence longer than the position table, a target >= vocab or -1 (not
    ignore_index): one process raises IndexError; at 2x2 the vocab-split lookup and loss read them as
    zero rows and returned a loss. Now every rank raises IndexRangeError (an IndexError) naming the value
    and the range, ignore_index still counts as valid, and the next call runs in step. Also: a model
    parallelized with labels=input_ids (the same tensor) computed its embedding from `labels`, so a
    later call with padded labels gave a wrong loss; the loss now equals one process's."""
    res = pool4.run(C.out_of_range)
    want = {"id = vocab": ("id 64", "[0, 64)", "'tok'"), "id = -1": ("id -1", "[0, 64)", "'tok'"),
            "sequence > positions": ("id 19", "[0, 16)", "'pos'"),
            "target = vocab": ("target 69", "[0, 64)", "ignore_index -100"),
            "target = -1": ("target -1", "[0, 64)", "ignore_index -100"),
            "llama id = vocab": ("id 96", "[0, 96)", "embed_tokens"),
            "llama label = vocab": ("target 200", "[0, 96)", "ignore_index -100")}
    for rank, r in enumerate(res):
        for case, parts in want.items():
            (one_kind, _), (kind, msg) = r[case]
            assert one_kind in ("IndexError", "RuntimeError"), (case, r[case])  # one process refuses too
            assert kind == "IndexRangeError" and all(p in msg for p in parts), (rank, case, msg)
        for case in ("ignore_index", "after errors", "example labels is input_ids"):
            one, par = r[case]
            assert abs(one - par) <= 1e-5 * abs(one), (rank, case, one, par)
