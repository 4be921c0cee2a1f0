"""Randomized parity sweep: small models drawn from the supported op set (linear stacks, attention
blocks with SDPA or written-out softmax attention, fused or separate q/k/v, LayerNorm or RMSNorm,
elementwise activations, reshapes), random sizes -- divisible by q or not -- on grids 1x1, 2x2, 3x3,
and on 4 ranks as 2x2, 1x4 or 4x1 with strategy 2d, 1d or auto (under random alpha-beta models);
outputs and every gradient against one process, on every rank, element-wise (tests/compare.py: rtol
1e-4 plus 1e-5 x the largest reference output / gradient).

The default budget is small for CI; AUTOPAR_SWEEP_EXAMPLES=N runs N cases per grid, and
AUTOPAR_SWEEP_LOG=FILE appends one line per passing case to FILE.
"""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import checks_robust as C
from tests.compare import assert_every_rank
from tests.conftest import get_pool

BUDGET = {1: 2, 2: 6, 3: 2, "4 ranks": 6}
N = os.environ.get("AUTOPAR_SWEEP_EXAMPLES")


@st.composite
def specs(draw):
    heads = draw(st.integers(1, 6))
    head_dim = draw(st.sampled_from([2, 4]))
    hidden = heads * head_dim
    return {
        "hidden": hidden, "heads": heads, "ffn": draw(st.sampled_from([hidden, 2 * hidden, 3 * hidden])),
        "features": draw(st.integers(2, 12)), "classes": draw(st.integers(2, 9)),
        "layers": draw(st.integers(1, 2)), "batch": draw(st.integers(1, 6)), "seq": draw(st.integers(2, 6)),
        "norm": draw(st.sampled_from(["layer", "rms"])), "fused": draw(st.booleans()),
        "attn": draw(st.sampled_from(["sdpa", "eager"])), "act": draw(st.sampled_from(["gelu", "silu", "tanh"])),
        "bias": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
    }


def _run(q, spec):
    where = "x".join(map(str, spec.get("grid", (q, q))))
    top = assert_every_rank(get_pool(q * q).run(C.sweep_case, spec), f"grid {where}, spec {spec}")
    if os.environ.get("AUTOPAR_SWEEP_LOG"):
        with open(os.environ["AUTOPAR_SWEEP_LOG"], "a") as f:
            f.write(f"{where} max_excess={top:.2e} {spec}\n")


def _sweep(q):
    @settings(max_examples=int(N) if N else BUDGET[q], deadline=None, derandomize=not N,
              suppress_health_check=[HealthCheck.too_slow])
    @given(spec=specs())
    def case(spec):
        _run(q, spec)

    case()


def test_sweep_1x1():
    _sweep(1)


def test_sweep_2x2():
    _sweep(2)


def test_sweep_3x3():
    _sweep(3)


@st.composite
def strategy_specs(draw):
    """A spec on 4 ranks: a 2x2, 1x4 or 4x1 grid and strategy 2d, 1d or auto (auto with a random
    alpha-beta model, so the chosen mixes of 2D, 1D and replicated units vary from case to case)."""
    spec = draw(specs())
    spec["grid"] = draw(st.sampled_from([(2, 2), (1, 4), (4, 1)]))
    spec["strategy"] = draw(st.sampled_from(["2d", "1d", "auto"]))
    if spec["strategy"] == "auto":
        spec["cost"] = (10 ** draw(st.floats(-6, -3)), 10 ** draw(st.floats(8, 11)), 10 ** draw(st.floats(8, 12)))
    return spec


def test_sweep_rectangular_grids_and_strategies():
    @settings(max_examples=int(N) if N else BUDGET["4 ranks"], deadline=None, derandomize=not N,
              suppress_health_check=[HealthCheck.too_slow])
    @given(spec=strategy_specs())
    def case(spec):
        _run(2, spec)

    case()
