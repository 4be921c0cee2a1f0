"""What the benchmarks share: the benchmark Llama (built from its config class) and its batches, the
bytes PyTorch's DTensor collectives receive and the calls they launch, peak memory readings, PyTorch's
own 1D tensor parallel plans (Megatron's, and torchtitan's with sequence parallelism and a
vocabulary-parallel loss), one training step of either, and a spawn of gloo ranks on this machine."""

from __future__ import annotations

import contextlib

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
    """Bytes received per rank by the functional collectives DTensor issues, CommLog conventions, and
    the collective calls (every functional collective but the waits)."""

    def __init__(self, world):
        super().__init__()
        self.world, self.bytes, self.calls = world, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if func.namespace == "_c10d_functional" and not name.startswith("wait"):
            self.calls += 1
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
        local = getattr(local, "elem", local)  # a functional collective's result not yet waited for
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loss_context(model):
        loss_of(model, batch(0))  # run for the hook: the saved tensors are what is measured
    return sum(seen.values())


def loss_context(model):
    """What a step of `model` runs in: `loss_parallel()` for `tp_sp`'s model (its loss reads logits
    split over the vocabulary, forward and backward), else nothing."""
    if getattr(model, "loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def loss_of(model, b):
    """The batch's mean next-token loss. `tp_sp`'s model returns logits split over the vocabulary and
    the loss is taken outside it, as torchtitan does, under `loss_context`; the others compute their
    own from `labels`."""
    if not getattr(model, "loss_parallel", False):
        return model(**b).loss
    from torch.distributed.tensor import DTensor, Replicate

    logits = model(input_ids=b["input_ids"]).logits
    labels = DTensor.from_local(b["labels"][:, 1:].reshape(-1), logits.device_mesh, [Replicate()], run_check=False)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels)


def forward_backward(model, b):
    with loss_context(model):
        loss = loss_of(model, b)
        loss.backward()
    return loss


def train_step(model, opt, step):
    forward_backward(model, batch(step))
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


def tp_sp(model):
    """torchtitan's tensor-parallel plan for Llama on all ranks, through PyTorch's own API: Megatron's
    column/row pairs with sequence parallelism (embedding output, norms and residuals split over the
    sequence; an all-gather before q|k|v and gate|up, a reduce-scatter after o and down) and the loss
    over logits split by vocabulary (`loss_of`). The residual stream stays a DTensor between modules
    (`use_local_output=False`) so that transformers' mask and rotary code see the full sequence."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    for layer in model.model.layers:
        plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
        plan.update({f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
        parallelize_module(layer, mesh, plan)
    model.loss_parallel = True
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


def spawn_json(target, world, *args) -> dict:
    """`spawn` target(rank, world, port, *args, out) and return the JSON its rank 0 wrote to `out`."""
    import json
    import os
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "bench.json")
    spawn(target, world, *args, out)
    with open(out) as f:
        return json.load(f)


def report(ns, res: dict, text: str, **setting) -> None:
    """Print a multi-rank benchmark's results: with --json, the benchmark model, its batch, `setting`
    and `res`; else `text` (the markdown tables)."""
    import json

    if ns.json:
        print(json.dumps({"model": CONFIG, **setting, "batch": BATCH, "seq": SEQ, "results": res}, indent=2))
    else:
        print(text)


def against(res: dict, labels, ref: str, ref_name: str, fields) -> list:
    """One line per configuration of `labels`: its `fields` ((name, result key) pairs) as ratios to
    configuration `ref`'s, and how far its losses are from `ref`'s (relative)."""
    b, lines = res[ref], []
    for label in labels:
        a = res[label]
        worst = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
        ratios = ", ".join(f"{name} {a[key] / b[key]:.2f}x" for name, key in fields)
        lines.append(f"{label} / {ref_name}: {ratios}; losses agree to {worst:.1e}")
    return lines
