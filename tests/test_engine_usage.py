"""Using the parallel model like the original one."""

from tests import checks_engine as C
from tests.compare import assert_every_rank


def test_other_shapes_modes_and_clipping(pool4):
    """Catches a compiled graph reused for a shape it was not built for (wrong local view sizes), a
    dropout left on in eval, and a gradient norm that double-counts replicated parameters."""
    res = pool4.run(C.everyday_use)
    assert_every_rank([r["excess"] for r in res], "eval at another shape, clipping")
    for rank, r in enumerate(res):
        assert r["graphs"] == 2, f"rank {rank}: {r['graphs']} compiled graphs, expected one per (mode, shapes)"
        assert r["train loss finite"], f"rank {rank}: train-mode loss is not finite"
