"""`autopar bench`'s report: the compiled rows are set against their eager twins (no timing asserted)."""

from autopar.bench import COMPILED, markdown

ROW = dict(bytes=2**20, param_bytes=2**20, saved_bytes=2**20, peak_rss_mb=1.0, peak_tensor_bytes=2**20)


def test_compiled_rows_report_the_ratio_to_eager():
    """Catches a compiled row set against the wrong eager row, or one left out of the report."""
    res = {"PyTorch 1D TP (4 ranks)": dict(ROW, step_s=0.4), "2D 2x2 broadcast": dict(ROW, step_s=0.5),
           "2D 2x2 broadcast" + COMPILED: dict(ROW, step_s=0.4),
           "PyTorch 1D TP (4 ranks)" + COMPILED: dict(ROW, step_s=0.3)}
    overhead = {"eager": 0.2, "autopar 1x1": 0.21, "autopar 1x1" + COMPILED: 0.15}
    text = markdown(res, overhead)
    assert "- 2D 2x2 broadcast: 400 ms compiled, 500 ms eager, ratio 0.80" in text, text
    assert "- PyTorch 1D TP (4 ranks): 300 ms compiled, 400 ms eager, ratio 0.75" in text, text
    assert "- autopar 1x1: 150 ms compiled, 210 ms eager, ratio 0.71" in text, text


def test_no_compiled_rows_without_compile():
    res = {"PyTorch 1D TP (4 ranks)": dict(ROW, step_s=0.4)}
    assert "torch.compile" not in markdown(res, {"eager": 0.2, "autopar 1x1": 0.21})
