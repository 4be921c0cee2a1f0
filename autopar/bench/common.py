"""What the benchmarks share: the benchmark Llama (built from its config class) and its batches, the
bytes PyTorch's DTensor collectives receive, peak memory readings, PyTorch's own 1D tensor parallel
plan, and a spawn of gloo ranks on this machine."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.launch import free_port
from passes.compat import TorchDispatchMode
from passes.cost.volumes import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=0, eos_token_id=0)
BATCH, SEQ = 8, 128


def model():
    """The benchmark Llama, seeded: every rank and the baseline build the same weights."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    return dict(input_ids=ids, labels=ids)


class FunctionalCommBytes(TorchDispatchMode):
    """Bytes received per rank by the functional collectives DTensor issues, CommLog conventions."""

    def __init__(self, world):
        super().__init__()
        self.world, self.bytes = world, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if func.namespace == "_c10d_functional":
            t = args[0]
            n = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            p = self.world
            if name.startswith("all_reduce"):
                self.bytes += all_reduce_bytes(n, p)
            elif name.startswith("all_gather"):
                self.bytes += all_gather_bytes(n, p)
            elif name.startswith("reduce_scatter"):
                self.bytes += reduce_scatter_bytes(n, p)
        return func(*args, **(kwargs or {}))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def saved_bytes(model):
    seen = {}

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch(0))  # run for the hook: the saved tensors are what is measured
    return sum(seen.values())


def train_step(model, opt, step):
    model(**batch(step)).loss.backward()
    opt.step()
    opt.zero_grad()


def tp_1d(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def local_bytes(model):
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())


def spawn(target, world, *args):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port) + args) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"autopar bench: a worker exited with code {p.exitcode}")
