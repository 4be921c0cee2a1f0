"""Using the parallel model like the original one."""

from tests import checks_engine as C
from tests.test_engine_parity import RTOL


def test_other_shapes_modes_and_clipping(pool4):
    """Catches a compiled graph reused for a shape it was not built for (wrong local view sizes), a
    dropout left on in eval, and a gradient norm that double-counts replicated parameters."""
    for rank, errs in enumerate(pool4.run(C.everyday_use)):
        bad = {k: v for k, v in errs.items() if not v < RTOL}
        assert not bad, f"rank {rank}: {bad}"
