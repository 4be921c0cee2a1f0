"""`autopar.verify`: the parallel program against the unmodified model on one process, and on a mismatch
the first graph node that differs. Bugs are injected in the checks (a wrong sharding rule through the rule
registry, a collective's backward); clean runs compare every node (nodes='always') so that a false
report of a divergence fails them."""

import subprocess
import sys

import pytest

from tests import checks_verify as C
from tests.conftest import get_pool


def test_a_wrong_rule_is_named_with_its_source_line():
    """Catches verify missing a wrong rule, blaming another node than the one the rule placed (here the
    softmax the registry's replacement runs on each column block), losing the user's source line, or
    reporting a mismatch with the right rule in place."""
    per_rank = get_pool(4).run(C.wrong_rule)
    for rank, r in enumerate(per_rank):
        right, wrong = r["right"], r["wrong"]
        assert right["ok"] and right["divergence"] is None, (rank, right["text"])
        assert set(right["worst"]) == {"loss", "output", "gradient", "parameter"}, right["worst"]
        assert max(right["worst"].values()) < 1e-5, right["text"]
        assert not wrong["ok"] and {"loss", "output", "gradient"} <= set(wrong["mismatched"]), wrong["text"]
        d = wrong["divergence"]
        assert d is not None and d["direction"] == "forward", wrong["text"]
        assert d["node"] == "softmax" and d["layout"] == "S(0)S(1)", wrong["text"]
        assert "checks_verify.py" in d["source"] and "h = torch.softmax(self.fc1(x), dim=-1)" in d["source"], d
        (name, layout, made, ok), = d["inputs"]
        assert (name, layout, ok) == ("linear", "S(0)S(1)", True) and "Summa" in made, d["inputs"]
        assert "first forward divergence: node 'softmax'" in wrong["text"], wrong["text"]
        assert wrong["text"] == per_rank[0]["wrong"]["text"], f"rank {rank}'s report differs from rank 0's"


def test_a_wrong_collective_backward_is_traced_to_it():
    """Catches a backward-only bug (1D's reduce-scatter of the sequence-parallel gather, doubled) reported
    as a forward one, or traced to another place than the gather after the final norm, whose backward
    feeds the first gradient that differs."""
    per_rank = get_pool(4).run(C.backward_bug)
    for r in per_rank:
        assert not r["ok"] and "gradient" in r["mismatched"] and "loss" not in r["mismatched"], r["text"]
        d = r["divergence"]
        assert d is not None and d["direction"] == "backward", r["text"]
        assert (d["node"], d["module"]) == ("layer_norm_2", "norm"), r["text"]
        assert len(d["users"]) == 1 and d["users"][0].startswith("autopar_redist_layer_norm_2"), d["users"]
        assert "redistribute S(0)" in d["users"][0], d["users"]


CLEAN = [dict(grid=(2, 2)),  # fast tier (with the pipeline and the Llama below)
         # gradients of inserted collectives (a part of their source's) and a sharded block's items once
         # reported as divergences of correct programs
         dict(family="llama", grid=(2, 2), strategy="auto"), dict(family="gpt2", grid=(2, 1, 2), data_parallel="shard"),
         dict(family="gpt2", grid=(1, 4), strategy="1d"),
         dict(grid=(2, 2), strategy="1d"), dict(grid=(2, 2), lowering="allgather"), dict(grid=(2, 2), lowering="ring"),
         dict(grid=(2, 2), recompute="blocks"), dict(grid=(2, 1, 2), data_parallel="shard"),
         dict(grid=(2, 1, 2)), dict(grid=(1, 2), layers=2, pipeline=2), dict(grid=(2, 2), compile=True),
         dict(grid=(2, 2), bf16=True)]  # bf16 weights and activations: bf16's tolerance


@pytest.mark.parametrize("options", CLEAN, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_correct_program_matches_at_every_node(options):
    """Catches a false divergence (a node whose value or gradient is this rank's share by design, a
    pipeline stage's node matched with the wrong node of the whole model) and a clean run that does not
    compare: every loss, output, gradient and parameter within tolerance and nodes counted."""
    per_rank = get_pool(4).run(C.clean, **options)
    for rank, r in enumerate(per_rank):
        assert r["ok"] and r["divergence"] is None, (rank, r["text"])
        assert {"loss", "gradient", "parameter"} <= set(r["worst"]), r["worst"]
        # compile=True: the nodes of the same step run again eagerly; with sharded replicas each block runs as
        # one call of its FSDP2 unit, compared as the block's output
        assert r["nodes"][0] > (5 if options.get("data_parallel") == "shard" else 20), (rank, r["nodes"])


def test_refusals_name_what_to_change():
    """Catches dropout verified against one process (each block draws its own mask: a mismatch that is no
    bug), a reference that cannot fit attempted anyway, a model without weights, and steps or nodes
    values accepted that mean nothing."""
    per_rank = get_pool(4).run(C.refusals)
    for r in per_rank:
        assert r["fits"] and "GiB free on this rank" in r["fits"] and "fewer layers" in r["fits"], r
        assert r["meta"] and "meta device" in r["meta"], r
        assert r["dropout"] and "dropout" in r["dropout"] and "probabilities at 0" in r["dropout"], r
        assert r["steps"] and "steps=0" in r["steps"], r
        assert r["nodes"] and "nodes='sometimes'" in r["nodes"], r


def test_command_line_exit_status():
    """Catches `autopar verify` not starting its ranks, not printing the report, or exiting 0 where a
    value differs (it exits 0 here: a correct program)."""
    cmd = [sys.executable, "-m", "autopar", "verify", "llama", "--grid", "1x2", "--set", "num_hidden_layers=1",
           "--set", "hidden_size=32", "--set", "intermediate_size=64", "--set", "num_attention_heads=4",
           "--set", "num_key_value_heads=2", "--set", "vocab_size=128", "--seq", "8", "--batch", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "autopar verify: every value matches" in done.stdout, done.stdout
    assert "largest gradient error" in done.stdout, done.stdout


def test_step_report_traces_every_collective_and_changes_nothing(tmp_path):
    """Catches a report that changes training (parameters after two AdamW steps must be bit-identical to a
    run without it), a trace that is not valid JSON or misses collectives (each rank's collective events
    per step are the collectives the dry run predicts for that rank, tag for tag), bytes the estimate
    prices differently from what the run moved, and refusals that do not say what to pass."""
    import collections
    import json

    import autopar
    from models import GPTConfig, TinyGPT

    per_rank = get_pool(4).run(C.step_report, str(tmp_path))
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert (tmp_path / "report.json").exists() and "written: " in per_rank[0]["text"], per_rank[0]["text"]
    torch_ = __import__("torch")
    torch_.manual_seed(0)
    cfg = GPTConfig(layers=1)
    ids = torch_.randint(0, cfg.vocab_size, (4, 8), generator=torch_.Generator().manual_seed(1))
    predicted = autopar.dry_run(TinyGPT(cfg), grid=(2, 2), example_inputs=(ids, ids), ranks="all")
    for rank, r in enumerate(per_rank):
        assert r["same"], f"rank {rank}: parameters differ after the steps recorded by the report"
        events = [e for e in trace["traceEvents"] if e.get("pid") == rank and e.get("tid") == 3 and e["ph"] == "X"
                  and not e["name"].startswith("wait-for-")]  # a wait for a launched collective: no call of its own
        traced = collections.Counter(e["name"].split(" ", 1)[1] for e in events)
        want = collections.Counter(c.node for c in predicted.ranks[rank].step
                                   if any(t == c.node for t, _ in r["tags"]))  # the program's (not the input check's)
        assert traced == collections.Counter({t: 2 * n for t, n in want.items()}), (rank, traced, want)
        assert sum(traced.values()) == r["calls"], (rank, sum(traced.values()), r["calls"])
        for row in r["rows"]:
            if row["estimated_bytes"]:
                assert row["estimated_bytes"] == row["measured_bytes"], row
            if row["op"] == "Summa" and row["collectives"]:  # a product run on its own (not a sibling group's
                # member) leaves at least its output block allocated (and a broadcast posted early for the next)
                assert row["measured_allocated_bytes"] >= row["estimated_saved_bytes"] > 0, row
        errors = r["errors"]
        assert errors["steps"] and "steps=0" in errors["steps"], errors
        assert errors["model"] and "autopar.parallelize returned" in errors["model"], errors
        assert errors["few"] == ["1 step(s) were marked, 3 asked for: the figures are per marked step"], errors
