"""examples/gpu_check.py, the first-GPU check, in its CPU fallback: the script runs from the source tree with
nothing but torch on the path and writes the JSON a GPU run writes, so that it cannot rot before a GPU comes."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_and_reports(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT  # as on a GPU machine with no registry: autopar from the source tree
    r = subprocess.run([sys.executable, "examples/gpu_check.py", "--tiny", "--steps", "1", "--no-compile", "--out",
                        str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] == __import__("torch").__version__
    eager = report["eager"]
    for name in ("plain", "autopar_1x1"):
        assert eager[name]["step_ms_back_to_back"] > 0 and eager[name]["tokens_per_s"] > 0, eager[name]
    # the same model, data and step: the losses agree
    assert abs(eager["plain"]["loss"] - eager["autopar_1x1"]["loss"]) <= 1e-4 * abs(eager["plain"]["loss"]), eager
    # on the CPU checks='auto' reads the input check at once (one read); the model's own step reads nothing
    assert eager["autopar_1x1"]["host_syncs_per_step"] == 1, eager["autopar_1x1"]["host_sync_sites"]
    assert eager["plain"]["host_syncs_per_step"] == 0, eager["plain"]["host_sync_sites"]
    dry = report["dry_run_2x4_rank0"]
    assert dry["bytes_per_step"] == dry["planned_bytes_per_step"] > 0 and dry["collectives_per_step"] > 0, dry
