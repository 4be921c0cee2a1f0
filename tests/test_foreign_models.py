"""Model code nobody here wrote, reduced to the construct that failed: parity with one process on
real gloo ranks."""

from tests import checks_foreign as C
from tests.compare import assert_every_rank


def test_slots_config_and_rotary_unbind_of_the_last_dim(pool4):
    """Catches parallelize writing to a user's config object (torchtitan's `slots=True` dataclass
    raised AttributeError at the end of parallelize) and the unbind rule indexing the pieces with the
    input's dim (x-transformers' rotary `unbind(-1)` raised IndexError), forward and backward."""
    res = pool4.run(C.slots_config_and_last_dim_unbind)
    assert_every_rank([r["excess"] for r in res], "RotaryBlock at 2x2")
    for rank, r in enumerate(res):
        assert (r["dim"], r["tp_size"]) == (32, 4), (rank, r)  # the config read through, the grid reported
        assert r["user config"] == "SlotsConfig(dim=32)", (rank, r["user config"])
