"""Memory held and bytes moved per rank: deterministic quantities, asserted exactly or by bound."""

import pytest

from tests import checks_engine as C
from tests.test_engine_parity import SMALL

ELT = 4  # fp32


def summa_volume(q, tokens, h_in, h_out, x_moves=True):
    """docs/design.md section 1: bytes received per rank for one SUMMA linear in a training step;
    without `x_moves`, the weight's share alone (a grouped sibling: `passes.transforms.group_siblings`)."""
    return 3 * (q - 1) * (tokens * h_in * x_moves + h_in * h_out) * ELT // (q * q)


@pytest.mark.parametrize("lowering", ["broadcast", "allgather", "ring"])
def test_summa_bytes_equal_analytic_volume(pool4, lowering):
    """Catches an extra or missing broadcast/reduce in AB/ABT/ATB, a block sent at the wrong size,
    or a lowering that moves more than the other. In the all-gather lowering q, k and v read one x and
    are grouped: x's panel and dX's partial sums move once, counted for q."""
    q, batch, seq = 2, 4, 8
    cfg = dict(SMALL, mlp="gelu")
    res = pool4.run(C.gpt_bytes, q, cfg, lowering, batch, seq)
    h, V, tokens = cfg["hidden"], cfg["vocab_size"], batch * seq
    want = {}
    for layer in range(cfg["layers"]):
        for proj in ("q", "k", "v", "proj"):
            grouped = lowering == "allgather" and proj in ("k", "v")
            want[f"blocks.{layer}.attn.{proj}"] = summa_volume(q, tokens, h, h, not grouped)
        want[f"blocks.{layer}.mlp.up"] = summa_volume(q, tokens, h, 4 * h)
        want[f"blocks.{layer}.mlp.down"] = summa_volume(q, tokens, 4 * h, h)
    # the tied LM head runs ABT on the [V, h] table: the same formula with the roles of in/out swapped
    want["head"] = 3 * (q - 1) * (tokens * V + V * h) * ELT // (q * q)
    for rank, r in enumerate(res):
        assert r["summa"] == want, f"rank {rank}: measured {r['summa']} != analytic {want}"
        assert r["planned"] == r["total"], f"rank {rank}: explain plans {r['planned']} B, ran {r['total']} B"
        assert any("e*(K*M*(C - 1) + K*N*(R - 1))/(C*R)" in line for line in r["why"]), r["why"][:3]


def test_memory_per_rank(pool4):
    """Catches a weight stored whole (or half) on a rank, activations gathered between layers, or a
    kernel saving full-size tensors for backward."""
    cfg = dict(SMALL, max_seq=16)
    res = pool4.run(C.gpt_memory, 2, cfg)
    p = 4
    for rank, r in enumerate(res):
        for name, (local, full, placements) in r["weights"].items():
            assert local * p <= full, f"rank {rank}: {name} holds {local} of {full} elements ({placements})"
        assert r["held"] <= 1.25 * r["full"] / p, f"rank {rank}: holds {r['held']} of {r['full']} parameters"
        ratio = r["saved"] * p / r["ref_saved"]
        assert ratio <= 1.3, (f"rank {rank}: saved-for-backward {r['saved']} B vs {r['ref_saved']} B "
                              f"on one process = {ratio:.2f}/p")


@pytest.mark.parametrize("grid,lowering", [((2, 2), "broadcast"), ((2, 2), "allgather"), ((1, 4), "broadcast"),
                                           ((4, 1), "allgather"), ((2, 2), "ring"), ((1, 4), "ring")])
def test_collective_calls_planned_equal_launched(pool4, grid, lowering):
    """Catches a spec whose launch count drifts from its kernel: a SUMMA step count off by the gcd, a
    broadcast root or reduce sender not counted, a collective over a one-member axis counted, an
    extra or missing norm / cross-entropy all-reduce; an explain that leaves out the overlap line or a
    product from it."""
    res = pool4.run(C.gpt_calls, grid, dict(SMALL, mlp="gelu"), lowering)
    for rank, r in enumerate(res):
        assert r["planned"] == r["counted"], f"rank {rank}: planned {r['planned']} (fwd, bwd), launched {r['counted']}"
        assert r["counted"][0] > 0 and r["counted"][1] > 0, r["counted"]
        for node, (planned, counted) in r["summa"].items():
            assert planned == counted, f"rank {rank}, {node}: planned {planned}, launched {counted}"
        total = sum(r["counted"])
        assert r["line"].startswith(f"collectives per rank per step: {total} "), r["line"]
        # explain says what runs behind the matmuls (overlap='auto' on the published figures: on), for every product
        (overlap,) = r["overlap"]
        assert overlap.startswith("overlap: on (") and f"of the {len(r['summa'])} SUMMA products'" in overlap, overlap
