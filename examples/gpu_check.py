"""The first-GPU check: one command, nothing installed beyond torch, a JSON of what it measured.

    PYTHONPATH=. python examples/gpu_check.py --out gpu_check.json       # or: make gpu-check

On a machine with a CUDA device: a GPT-2-small-shaped model (12 layers, 768 wide, 12 heads, 50,257-token
vocabulary, 124M parameters; `models.TinyGPT`) in bf16 on a batch of 8 x 1024, one AdamW step after
another, as plain PyTorch and as `autopar.parallelize(grid=(1, 1))` (NCCL over one rank), eager and
compiled: step time with a sync after every step and back to back, tokens/s, peak GiB, host syncs per
step (`autopar.count_host_syncs`, checks at their default). Then rank 0 of a 2x4 grid, dry-run under
the fake process group (`autopar.dry_run`): its collectives and bytes. Without a GPU (`--tiny`, and
what runs in the test suite so that this script cannot rot): a tiny model in fp32 on the CPU over gloo.
Multi-GPU parity and timing are not part of it yet (the JSON says so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py beside this file

import autopar  # noqa: E402
from models import GPTConfig, TinyGPT  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps(model, ids, steps: int, device) -> dict:
    """Time `steps` AdamW steps of `model` on (ids, ids): synced after each, then back to back."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(ids, ids)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):  # warm-up: compiles, allocator, kernels chosen
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synced = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        synced.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _sync(device)
    back = (time.perf_counter() - t0) / steps
    with autopar.count_host_syncs() as syncs:
        model(ids, ids)[1].backward()
    opt.zero_grad(set_to_none=True)
    synced.sort()
    return {"step_ms_synced": 1e3 * synced[len(synced) // 2], "step_ms_back_to_back": 1e3 * back,
            "tokens_per_s": ids.numel() / back, "loss": float(loss),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "host_syncs_per_step": syncs.total, "host_sync_sites": dict(syncs.sites)}


def single_device(cfg: GPTConfig, batch: int, dtype, device, steps: int, compiled: bool) -> dict:
    """Plain PyTorch and autopar on a 1x1 grid, the same model, data and steps."""
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq), device=device)
    out = {}
    for name in ("plain", "autopar_1x1"):
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(device=device, dtype=dtype)
        if name == "autopar_1x1":
            model = autopar.parallelize(model, grid=(1, 1), example_inputs=(ids, ids), compile=compiled)
        elif compiled:
            model = torch.compile(model)
        out[name] = _steps(model, ids, steps, device)
        del model
    out["autopar_over_plain_back_to_back"] = out["autopar_1x1"]["step_ms_back_to_back"] / \
        out["plain"]["step_ms_back_to_back"]
    return out


def dry_run_2x4(cfg: GPTConfig, batch: int) -> dict:
    """Rank 0 of a 2x4 grid under the fake process group: its collectives and bytes (no GPU needed)."""
    with torch.device("meta"):
        model = TinyGPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq))
    run = autopar.dry_run(model, (2, 4), (ids, ids), ranks=[0]).ranks[0]
    return {"collectives_per_step": len(run.step), "bytes_per_step": run.counted["grid"],
            "planned_bytes_per_step": run.planned, "held_bytes": run.held}


def versions(device) -> dict:
    v = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
         "cuda": torch.version.cuda, "autopar": autopar.__version__}
    if device.type == "cuda":
        v["gpu"] = torch.cuda.get_device_name(device)
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        v["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU (gloo): the check itself")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement (default: %(default)s)")
    parser.add_argument("--no-compile", action="store_true", help="eager only (the test suite's quick run)")
    ns = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not ns.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        cfg = GPTConfig(vocab_size=50257, max_seq=1024, hidden=768, heads=12, layers=12)  # GPT-2 small's shapes
        batch, dtype = 8, torch.bfloat16
    else:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
        cfg, batch, dtype = GPTConfig(layers=2), 2, torch.float32
    report = {"versions": versions(device), "model": {**vars(cfg), "batch": batch, "dtype": str(dtype)}}
    started = time.perf_counter()
    report["dry_run_2x4_rank0"] = dry_run_2x4(cfg, batch)  # before a process group of its own: it starts fake ones
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1, device_id=device if gpu else None)
    try:
        for compiled in (False,) if ns.no_compile else (False, True):
            key = "compiled" if compiled else "eager"
            report[key] = single_device(cfg, batch, dtype, device, ns.steps, compiled)
    finally:
        dist.destroy_process_group()
    report["multi_gpu"] = f"not run: {torch.cuda.device_count()} GPU(s) here; the 8-GPU parity sweep is not built yet"
    report["seconds"] = time.perf_counter() - started
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    for key in [k for k in ("eager", "compiled") if k in report]:
        r = report[key]
        print(f"{key:>8}: plain {r['plain']['step_ms_back_to_back']:.1f} ms/step, autopar 1x1 "
              f"{r['autopar_1x1']['step_ms_back_to_back']:.1f} ms/step ({r['autopar_over_plain_back_to_back']:.2f}x), "
              f"host syncs/step {r['plain']['host_syncs_per_step']} vs {r['autopar_1x1']['host_syncs_per_step']}")
    print(f"wrote {ns.out} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
