"""Guards of parallelize and of a call: nothing hangs, nothing silently wrong."""


import re
import time

import pytest

from tests.dist_pool import spawn_fresh
from tests import checks_api_guards as C


def test_options_that_differ_between_ranks_raise_everywhere(pool4):
    """A different lowering, check_inputs or grid on one rank used to pass parallelize (or fail after
    30 s in the store) and die at the first call; now every rank raises the same UsageError up front."""
    res = pool4.run(C.options_differ)
    for rank, r in enumerate(res):
        for key, value in (("lowering", "'allgather'"), ("check_inputs", "True"), ("grid", "(1, 4)")):
            kind, msg = r[key]
            assert kind == "UsageError", (rank, key, kind, msg)
            assert f"ranks called parallelize with different {key}" in msg and value in msg, (rank, msg)
        kind, msg = r["bool grid"]
        assert kind == "UsageError" and "grid=(True, 4): expected (R, C) of positive ints" in msg, (rank, msg)
        kind, msg = r["reordered"]  # same ops, other order: the hint names hash randomization
        assert kind == "UsageError" and "ranks built different plans" in msg, (rank, msg)
        assert "same ops in a different order" in msg and "PYTHONHASHSEED" in msg, (rank, msg)
        kind, msg = r["timeout"]
        assert kind == "UsageError" and "timeout=-1: expected a positive number of seconds" in msg, (rank, msg)


def test_check_inputs_compares_bytes(pool4):
    """Swapping two token ids on one rank kept the sum and sum of squares that check_inputs compared,
    and gave ~10% wrong logits unnoticed; identical inputs holding NaN raised a false alarm; a rank
    drawing its own batch trained silently on the wrong data (check_inputs was off by default)."""
    res = pool4.run(C.check_inputs_cases)
    for rank, r in enumerate(res):
        kind, msg = r["swapped"]
        assert kind == "UsageError", (rank, kind)
        assert "positional input 0 differs between the ranks of this grid: ranks [2]" in msg, (rank, msg)
        # each rank's own batch (DDP's habit) trained on a mix of batches with no word, check_inputs
        # being off by default: now the default check names the input and the ranks that differ
        kind, msg = r["own batch"]
        assert kind == "UsageError" and "positional input 0 differs between the ranks of this grid: ranks " \
            "[1, 2, 3] got other values than rank 0" in msg and "check_inputs=False" in msg, (rank, msg)
        assert r["same batch"] == (None, ""), (rank, r["same batch"])
        assert r["own batch, off"] == (None, ""), (rank, r["own batch, off"])
        assert r["nan identical"] == (None, ""), (rank, r["nan identical"])
        kind, msg = r["int to float model"]
        assert kind == "UsageError" and "aten.linear in module lin" in msg and "torch.int64" in msg, (rank, msg)
        assert "checks_api_guards.py" in msg, msg  # the user's source line
        kind, msg = r["int call"]
        assert kind == "UsageError" and "input 0 is torch.int64" in msg and "torch.float32" in msg, (rank, msg)


def test_no_host_sync_in_a_step_with_late_checks(pool4):
    """Every call read its checks' verdicts on the host (check_inputs 2 reads, each vocab-split table's id
    range 2, the cross-entropy targets 1): on a GPU each read stalls the queue. With checks='late' (the
    default on accelerators) a 2x2 step reads nothing; with 'now' one read per check (4: inputs, two
    tables, targets). A late verdict raises at the next call, on every rank, naming it as the previous
    call's, and the call after that runs."""
    res = pool4.run(C.host_syncs)
    for rank, r in enumerate(res):
        assert r["late"] == [(0, {}), (0, {})], (rank, r["late"])
        for total, sites in r["now"]:
            assert total == 4 and sum(sites.values()) == 4, (rank, sites)
            assert sum(n for s, n in sites.items() if s.startswith("inputs.py")) == 1, (rank, sites)
        first, second, third = r["late id"]
        assert first == (None, "") and third == (None, ""), (rank, r["late id"])
        assert second[0] == "IndexRangeError" and "id 67 is outside [0, 64)" in second[1], (rank, second)
        assert "previous call's check" in second[1], (rank, second)
        first, flushed = r["late target"]
        assert first == (None, "") and flushed[0] == "IndexRangeError", (rank, r["late target"])
        assert ("target -7 is outside [0, 64)" if rank // 2 == 1 else "1 target(s) outside [0, 64)") in flushed[1], \
            (rank, flushed)
        first, second = r["late own batch"]
        assert first == (None, "") and second[0] == "UsageError", (rank, r["late own batch"])
        assert "were passed different inputs (values)" in second[1] and "checks='now'" in second[1], (rank, second)


def test_full_state_dict_and_clipping(pool4):
    """pm.load_state_dict with plain full tensors failed with DTensor's 'mixed Tensor and DTensor';
    pm.clip_grad_norm_ must match torch's on one process for the 2-, inf- and 1-norm (each block
    counted once, not once per replica of a replicated bias)."""
    res = pool4.run(C.state_dict_and_clip)
    for rank, r in enumerate(res):
        bad = {k: v for k, v in r["errs"].items() if not v <= 1}
        assert not bad, (rank, bad)
        kind, msg = r["wrong shape"]
        assert kind == "UsageError" and "'tok.weight' has shape (3, 3)" in msg, (rank, msg)


def test_clipping_is_quiet_and_agrees(pool4):
    """torch.nn.utils.clip_grad_norm_ over the DTensor gradients reduced the total norm with one
    all-reduce per mesh axis, and DTensor printed "2 sequential all_reduce operations ... may give
    inconsistent results" on every rank. With the grid's flattened mesh it is one all-reduce, silent;
    pm.clip_grad_norm_ never went through DTensor. Both norms: one process's, bit-equal on every rank."""
    res = pool4.run(C.clipping_is_quiet)
    for rank, r in enumerate(res):
        assert r["dtensor warnings"] == [], (rank, r["dtensor warnings"])
        for path in ("pm", "torch"):
            norm, err = r[path]
            assert err <= 1, (rank, path, norm, err)
            assert norm == res[0][path][0], (rank, path, norm, res[0][path][0])


def _run_skipped(tmp_path, what):
    hung = spawn_fresh(C.skipped_collective, 4, str(tmp_path), what).join(ranks=range(3), timeout=90)
    assert not hung, hung
    return [open(tmp_path / f"rank{r}.txt").read().split("\n", 2) for r in range(3)]


@pytest.mark.parametrize("what", ["check_inputs", "clip", "torch clip"])
def test_timeout_bounds_every_collective(tmp_path, what):
    """With timeout=5 a rank that skips a step used to block check_inputs, clip_grad_norm_ and DTensor's
    own collectives for the process group's timeout (201 s measured; 30 min by default)."""
    for rank, (kind, secs, msg) in enumerate(_run_skipped(tmp_path, what)):
        assert float(secs) < 30, (rank, secs, msg)
        if what == "torch clip":  # torch's own function: its error, but bounded by the grid's groups
            assert kind not in ("None", ""), (rank, kind, msg)
        else:
            assert kind == "CollectiveError" and "failed on rank" in msg, (rank, kind, msg)
            # the hang diagnosis: rank 3 sleeps outside any collective, so it cannot report
            assert "hang diagnosis: " in msg and "rank(s) 3 did not report" in msg, (rank, msg)


def test_replicas_with_timeout(pool4):
    """With dp > 1 and timeout=, every rank must create every bounded group in the same order (a
    different order hangs), and the clipped norm counts each block once across replicas."""
    for rank, errs in enumerate(pool4.run(C.replicas_with_timeout)):
        bad = {k: v for k, v in errs.items() if not v <= 1}
        assert not bad, (rank, bad)


def test_a_skipped_collective_is_named_by_every_rank(tmp_path, monkeypatch):
    """Rank 3 skips one broadcast of a step (timeout=3). Every rank's CollectiveError carries the hang
    diagnosis within 10 s of the step's start: the reports it heard, the first call number at which the
    members of one group disagree -- naming rank 3 and the graph node -- and where each rank waits."""
    monkeypatch.setenv("AUTOPAR_FLIGHT_DIR", str(tmp_path))  # inherited by the spawned ranks
    monkeypatch.setenv("AUTOPAR_FLIGHT_WAIT", "5")  # the library's default (the suite's is 1 s)
    hung = spawn_fresh(C.skips_one_broadcast, 4, str(tmp_path)).join(timeout=90)
    assert not hung, hung
    for rank in range(4):
        kind, secs, msg = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 2)
        assert kind == "CollectiveError", (rank, kind, msg)
        assert float(secs) < 10, (rank, secs, msg)
        assert "hang diagnosis: " in msg and "first disagreement: " in msg, (rank, msg)
        first = msg.split("first disagreement: ", 1)[1].split("\n  rank", 1)[0]
        detail = msg.split("first disagreement: ", 1)[1]
        assert "rank 3 issued broadcast" in detail or "rank 3 has issued only" in detail, (rank, msg)
        assert "call #" in first, (rank, first)
        # the graph node and the model's module it came from
        assert re.search(r"rank 3 issued broadcast \[\d+, \d+\] float32 for 'linear\w*' \([\w.]+\)", detail) or \
            "rank 3 has issued only" in detail, (rank, detail)
        assert f"rank {rank} waits " in msg, (rank, msg)
        assert (tmp_path / f"autopar-flight-rank{rank}.json").exists(), rank


def test_a_hang_is_diagnosed_while_it_waits(tmp_path, monkeypatch):
    """With AUTOPAR_HANG_AFTER=2 and the collectives' own timeout at 60 s (NCCL's case: a timed-out
    collective never raises there), each rank's watcher diagnoses the skipped broadcast while every rank
    still waits, within 10 s of the bad step's start, into autopar-hang-rank<N>.txt; with
    AUTOPAR_HANG_EXIT=1 the processes then end themselves (status 3), rank 0 last, well before the 60 s."""
    monkeypatch.setenv("AUTOPAR_FLIGHT_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_FLIGHT_WAIT", "2")  # 4 local ranks' reports arrive in 0.3 s
    monkeypatch.setenv("AUTOPAR_HANG_AFTER", "2")
    monkeypatch.setenv("AUTOPAR_HANG_EXIT", "1")
    ranks = spawn_fresh(C.skips_one_broadcast, 4, str(tmp_path), 60)
    files = [tmp_path / f"autopar-hang-rank{r}.txt" for r in range(4)]
    started = time.time()
    assert ranks.join(timeout=50) == "", "a rank did not end itself after its diagnosis"
    ended = time.time() - started
    # each ends itself (status 3) once its diagnosis is written; a rank whose collective fails first because
    # a peer has gone ends through the check's own handling of that error (status 0): both are the job stopping
    codes = [p.exitcode for p in ranks]
    assert set(codes) <= {0, 3} and 3 in codes, codes
    assert ended < 45, ended  # start-up, one good step, 2 s of waiting, the diagnosis, rank 0's 5 s for reports
    for rank, f in enumerate(files):
        assert f.exists(), f"rank {rank} wrote no diagnosis"
        text = f.read_text()
        began = float((tmp_path / f"start{rank}.txt").read_text())
        assert f.stat().st_mtime - began < 10, (rank, f.stat().st_mtime - began, text)
        failed = tmp_path / f"rank{rank}.txt"  # written where the rank's collective failed after its peers left
        assert not failed.exists() or failed.stat().st_mtime >= f.stat().st_mtime, rank  # diagnosed while waiting
        assert f"autopar: rank {rank} has waited " in text and "first disagreement: " in text, (rank, text)
        detail = text.split("first disagreement: ", 1)[1]
        assert "rank 3 issued broadcast" in detail or "rank 3 has issued only" in detail, (rank, text)
