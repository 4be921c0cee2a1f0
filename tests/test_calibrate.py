"""`autopar calibrate` on real gloo ranks: the measured model's schema and fit, the JSON round trip,
the refusal of a stale file, an axis of size 1, and the CLI end to end. No timing assertions beyond
positivity: the values depend on the machine."""

import json
import math
import subprocess
import sys

import pytest

from autopar.planning import calibrate as cal
from passes.cost.model import CostModel

SIZES = (4096, 65536)  # small: the test checks the plumbing, not this machine's bandwidth
ROOT = __file__.rsplit("/tests/", 1)[0]


def measure_on_rank(rank, grid, sizes, repeats, **matmul):  # runs on every rank of the pool
    return cal.measure(tuple(grid), sizes, repeats, **matmul)


def _check_schema(model, grid, sizes):
    assert set(model) == set(cal.KEYS) | set(cal.OPTIONAL_KEYS), sorted(model)
    assert model["memory_bytes_per_s"] > 0 and model["op_s"] > 0
    assert model["version"] == 1 and model["source"] == "calibrate"
    assert model["grid"] == list(grid) and model["backend"] == "gloo" and model["device"] == "cpu"
    assert len(model["axes"]) == 2 and model["flops_per_s"] > 0
    for axis, ax in enumerate(model["axes"]):
        assert set(ax) == set(cal.AXIS_KEYS), ax
        if grid[axis] == 1:
            assert ax == {"alpha_s": 0.0, "beta_bytes_per_s": math.inf, "points": []}
            continue
        assert ax["alpha_s"] >= 0 and 0 < ax["beta_bytes_per_s"] < math.inf, ax
        assert len(ax["points"]) == 2 * len(sizes)  # broadcast and all-reduce per size
        g = grid[axis]
        want = sorted(b for n in sizes for b in (n, 2 * (g - 1) * n / g))  # CommLog conventions
        assert sorted(b for b, _ in ax["points"]) == want
        assert all(sec > 0 for _, sec in ax["points"])


def test_measure_2x2_save_load(pool4, tmp_path):
    """Schema, fit bounds and points on a 2x2 grid; every rank returns the same figures (max over
    ranks); save -> load through a real file gives the model back."""
    shapes = ((64, 32, 16), (128, 64, 32))
    per_rank = pool4.run(measure_on_rank, (2, 2), SIZES, 2, dtype="bf16", shapes=shapes, peak_flops=1e12)
    for model in per_rank:
        _check_schema(model, (2, 2), SIZES)
        assert model["axes"] == per_rank[0]["axes"] and model["flops_per_s"] == per_rank[0]["flops_per_s"]
        mm = model["matmul"]  # the model's dtype and shapes, each timed; the rate is theirs together
        assert mm["dtype"] == "bf16" and mm["tf32"] is None and mm == per_rank[0]["matmul"]
        assert [(r["m"], r["k"], r["n"]) for r in mm["shapes"]] == list(shapes)
        flops = sum(2 * m * k * n for m, k, n in shapes)
        assert model["flops_per_s"] == pytest.approx(flops / sum(r["seconds"] for r in mm["shapes"]), rel=1e-12)
        assert mm["peak_flops"] == 1e12 and mm["peak_fraction"] == pytest.approx(model["flops_per_s"] / 1e12)
        # the share of a transfer a matmul hides: measured, a share, the least any rank saw (the same on all)
        assert 0.0 <= model["hidden"] <= 1.0 and model["hidden"] == per_rank[0]["hidden"], model["hidden"]
    assert CostModel.from_dict(per_rank[0]).hidden == per_rank[0]["hidden"]
    path = tmp_path / "cal.json"
    cal.save(per_rank[0], path)
    assert cal.load(path) == per_rank[0]


def test_measure_1x4_unit_axis_is_null_in_json(pool4, tmp_path):
    """Axis 0 of a 1x4 grid never communicates: beta inf in memory, null in the file, inf again after
    load; axis 1 is measured over all 4 ranks."""
    model = pool4.run(measure_on_rank, (1, 4), SIZES, 2)[0]
    _check_schema(model, (1, 4), SIZES)
    mm = model["matmul"]  # the defaults: fp32 on the CPU, one 1024^3 product, no preset to compare with
    assert mm["dtype"] == "fp32" and [(r["m"], r["k"], r["n"]) for r in mm["shapes"]] == [(1024, 1024, 1024)]
    assert mm["peak_fraction"] is None
    path = tmp_path / "cal.json"
    cal.save(model, path)
    raw = json.loads(path.read_text())
    assert raw["axes"][0]["beta_bytes_per_s"] is None and raw["axes"][1]["beta_bytes_per_s"] is not None
    assert cal.load(path)["axes"][0]["beta_bytes_per_s"] == math.inf


@pytest.mark.parametrize("edit, why", [
    (lambda m: m.update(version=2), "version 2"),
    (lambda m: m.pop("axes"), "missing key(s) ['axes']"),
    (lambda m: m["axes"][1].pop("alpha_s"), "axes[1] lacks ['alpha_s']"),
    (lambda m: m["axes"][0].update(beta_bytes_per_s=-1.0), "beta_bytes_per_s > 0"),
    (lambda m: m.update(hidden=1.5), "'hidden' (the share of a transfer a concurrent matmul hides) must be"),
])
def test_load_rejects_bad_file(tmp_path, edit, why):
    """A stale or damaged file is refused with what is wrong and how to fix it."""
    model = json.loads(json.dumps(cal.DEFAULT))
    edit(model)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(model))
    with pytest.raises(ValueError) as e:
        cal.load(path)
    assert why in str(e.value) and "re-run `autopar calibrate" in str(e.value), str(e.value)


def test_default_is_valid_and_round_trips(tmp_path):
    assert cal.validate(cal.DEFAULT) == cal.DEFAULT
    assert [ax["beta_bytes_per_s"] for ax in cal.DEFAULT["axes"]] == [25e9, 150e9]  # axis 1 inside a node
    cal.save(cal.DEFAULT, tmp_path / "d.json")
    assert cal.load(tmp_path / "d.json") == cal.DEFAULT


def test_fit_alpha_beta():
    """Exact points give alpha, beta back; a negative intercept is clipped to 0 with the slope refitted;
    time falling with size (noise) gives a finite beta that is a lower bound, max(bytes / seconds)."""
    alpha, beta = 5e-5, 2e9
    pts = [[x, alpha + x / beta] for x in (4096, 65536, 1 << 20)]
    a, b = cal.fit_alpha_beta(pts)
    assert a == pytest.approx(alpha) and b == pytest.approx(beta)
    a, b = cal.fit_alpha_beta([[1000, 1e-6], [2000, 3e-6]])  # line through (0, -1e-6): clipped
    assert a == 0 and b == pytest.approx(5e9 / 7)  # through the origin: sum(x t) / sum(x x)
    a, b = cal.fit_alpha_beta([[1000, 2e-6], [2000, 1e-6]])
    assert a == pytest.approx(1.5e-6) and b == pytest.approx(2e9)
    with pytest.raises(ValueError, match="bytes > 0 and seconds > 0"):
        cal.fit_alpha_beta([[1000, 0.0]])


def test_cli_end_to_end(tmp_path):
    """`python -m autopar calibrate` spawns its own 2 gloo ranks and writes a loadable file."""
    out = tmp_path / "cal.json"
    cmd = [sys.executable, "-m", "autopar", "calibrate", "--grid", "1x2", "--out", str(out),
           "--repeats", "2", "--sizes", "4096", "65536", "--dtype", "bf16", "--shapes", "64x64x64,32x64x128",
           "--cluster", "dgx-h100"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mesh axis 1: alpha" in proc.stdout and "GFLOP/s (bf16, 2 shape(s))" in proc.stdout, proc.stdout
    assert "32x64x128: " in proc.stdout and "of the preset's dense peak (989.4 TFLOP/s)" in proc.stdout, proc.stdout
    model = cal.load(out)
    _check_schema(model, (1, 2), (4096, 65536))


def test_the_model_s_products_and_bad_shapes():
    """`calibrate --model` times the products of a block and the LM head at the model's sizes (Llama 3 8B:
    q|o, k|v, gate|up, down, the head); `--shapes` and `--cluster` refuse what they cannot read."""
    assert cal.model_shapes("llama3-8b", 1024, 2) == ((2048, 4096, 4096), (2048, 4096, 1024), (2048, 4096, 14336),
                                                      (2048, 14336, 4096), (2048, 4096, 128256))
    assert cal.parse_shapes("8x4x2,1x1x1") == ((8, 4, 2), (1, 1, 1))
    for text, words in (("8x4", "is not MxKxN"), ("8x0x2", "must be positive")):
        with pytest.raises(ValueError, match=words):
            cal.parse_shapes(text)
    cmd = [sys.executable, "-m", "autopar", "calibrate", "--grid", "1x2", "--cluster", "dgx-h900"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "expected one of the presets" in proc.stderr, proc.stderr
