"""`python -m autopar bench --moe`: a Mixtral-style mixture of experts (transformers' MixtralConfig,
random weights) trained for a few steps on 4 gloo ranks as

- one process, no parallelism;
- autopar on a 2x2 grid and on a 1x4 grid (experts over the rows, each expert's intermediate dim over
  the columns: docs/design.md section 8);
- PyTorch's 1D tensor parallel on 4 ranks: `parallelize_module` with q/k/v column-wise and o
  row-wise (as `autopar.bench` builds it for Llama), and the experts split by `ExpertIntermediateParallel`
  below. PyTorch ships no ParallelStyle for transformers' grouped experts (3-D weights dispatched by
  index, not nn.Linear modules): this one is made of DTensor's public pieces and is the layout of
  transformers' own Mixtral `tp_plan` (gate|up column-wise, down row-wise, the output summed).

Per configuration: the median step time, bytes received per rank per step (autopar's collective
layer; DTensor's functional collectives counted with the same conventions), the parameters one rank
holds (and against 1/p of the model), and whether every step's loss matches one process's (rtol 1e-4).
Configurations alternate round by round, so machine noise spreads over all of them.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ParallelStyle

import autopar
from autopar.bench import common
from autopar.bench.common import FunctionalCommBytes
from autopar.launch import close, init_local
from autopar.errors import UsageError

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
              output_router_logits=True, pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
BATCH, SEQ = 8, 128
LOSS_RTOL = 1e-4
ONE, TORCH_TP = "one process", "PyTorch 1D TP + expert TP (4 ranks)"
GRIDS = {"autopar 2x2": (2, 2), "autopar 1x4": (1, 4)}


def model():
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))


def batch(step):
    ids = torch.randint(1, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return dict(input_ids=ids, labels=ids)


class ExpertIntermediateParallel(ParallelStyle):
    """Split every expert's intermediate dim over a 1-D mesh (Megatron's column/row pair per expert).

    For an experts module with `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
    [E, H, I]: rank r holds gate_up rows [gate block r; up block r] [E, 2I/p, H] and down_proj
    [E, H, I/p] as DTensors (Shard(1), Shard(2)). The module's own forward runs on those local blocks
    with the tokens and routing weights whole, so each rank's output is its intermediate block's share
    of the sum; one all-reduce makes it whole. Backward: the gradients of the tokens and of the routing
    weights are likewise shares, summed by one all-reduce each (DTensor's Partial -> Replicate).
    """

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        p = device_mesh.size()
        e, two_i, h = module.gate_up_proj.shape
        if (two_i // 2) % p:
            raise UsageError(f"ExpertIntermediateParallel: intermediate size {two_i // 2} is not divisible by "
                             f"the mesh size {p}; use a mesh size that divides it")
        # [E, 2, p, I/p, H] -> [E, p, 2, I/p, H]: rank r's rows are its gate block, then its up block
        blocks = module.gate_up_proj.detach().view(e, 2, p, two_i // 2 // p, h).transpose(1, 2).reshape(e, two_i, h)
        module.gate_up_proj = torch.nn.Parameter(distribute_tensor(blocks, device_mesh, [Shard(1)]))
        module.down_proj = torch.nn.Parameter(distribute_tensor(module.down_proj.detach(), device_mesh, [Shard(2)]))
        twin = copy.copy(module)  # the class's forward on another object: the module's own is replaced
        twin._parameters = dict(module._parameters)
        module.forward = lambda x, index, weights: _experts_on_blocks(twin, module, device_mesh, x, index, weights)
        return module


def _experts_on_blocks(twin, module, mesh, x, index, weights):
    """The experts' forward on this rank's weight blocks; tokens [T, H] and weights [T, k] whole."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def shared(t):  # whole on every rank; its gradient arrives as this rank's share and is summed
        return DTensor.from_local(t, mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    local = {n: getattr(module, n).to_local() for n in ("gate_up_proj", "down_proj")}
    y = torch.func.functional_call(twin, local, (shared(x), index, shared(weights)))  # [T, H], a share
    return DTensor.from_local(y, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()


def tp_1d(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.experts": ExpertIntermediateParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def _loss(out) -> float:
    loss = out.loss
    return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())


def worker(rank, world, port, rounds, steps, out):
    init_local(rank, world, port)
    base = model()
    configs = {ONE: base} if rank == 0 else {}
    for name, grid in GRIDS.items():
        configs[name] = autopar.parallelize(copy.deepcopy(base), grid=grid, example_kwargs=batch(0))
    configs[TORCH_TP] = tp_1d(copy.deepcopy(base))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in configs.items()}
    res: dict = {k: {"losses": [], "times": []} for k in configs}
    order = list(configs.items()) if rank == 0 else [(ONE, None)] + list(configs.items())  # same everywhere
    for r in range(rounds):
        for k, m in order:
            dist.barrier()
            if m is None:
                continue
            for s in range(steps):
                first = r == 0 and s == 0  # warm-up: bytes counted here, time not
                log = getattr(m, "grid", None) and m.grid.log
                if first and log:
                    log.reset()
                counter = FunctionalCommBytes(world) if first else None
                t0 = time.perf_counter()
                if counter is not None:
                    with counter:
                        o = m(**batch(r * steps + s))
                        o.loss.backward()
                else:
                    o = m(**batch(r * steps + s))
                    o.loss.backward()
                opts[k].step()
                opts[k].zero_grad()
                if not first:
                    res[k]["times"].append(time.perf_counter() - t0)
                else:
                    res[k]["bytes"] = log.total() if log else counter.bytes
                res[k]["losses"].append(_loss(o))
    dist.barrier()
    for k, m in configs.items():
        res[k]["step_s"] = statistics.median(res[k].pop("times"))
        res[k]["param_bytes"] = common.local_bytes(m)
        res[k]["total_param_bytes"] = sum(p.numel() * p.element_size() for p in m.parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        for k in res:  # the slowest rank's time, the fullest rank's parameters and traffic
            for key in ("step_s", "param_bytes", "bytes"):
                res[k][key] = max(e[k][key] for e in everyone if k in e)
        with open(out, "w") as f:
            json.dump(res, f)
    close()


def losses_match(losses, reference, rtol=LOSS_RTOL) -> float:
    """The largest |loss - reference| / |reference| over the steps (inf when the step counts differ)."""
    if len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def markdown(res: dict, world: int = 4) -> str:
    """The MoE table: one line per configuration, losses set against one process's."""
    ref = res[ONE]["losses"]
    lines = ["| configuration | step (median) | received/rank/step | params/rank | params x 1/p | "
             "losses vs one process |", "|---|---|---|---|---|---|"]
    for k, r in res.items():
        held = r["param_bytes"] * world / r["total_param_bytes"]
        if k == ONE:
            match = "-"
        else:
            worst = losses_match(r["losses"], ref)
            match = f"{'match' if worst <= LOSS_RTOL else 'MISMATCH'} ({worst:.1e})"
        lines.append(f"| {k} | {r['step_s'] * 1e3:.0f} ms | {r['bytes'] / 2**20:.1f} MiB | "
                     f"{r['param_bytes'] / 2**20:.1f} MiB | {held:.2f} | {match} |")
    return "\n".join(lines)


def run(ns) -> int:
    """The MoE benchmark for `autopar bench`'s parsed flags (--rounds, --steps, --json)."""
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "bench_moe.json")
    common.spawn(worker, 4, ns.rounds, ns.steps, out)
    with open(out) as f:
        res = json.load(f)
    if ns.json:
        print(json.dumps({"model": CONFIG, "batch": BATCH, "seq": SEQ, "results": res}, indent=2))
    else:
        print(f"Mixtral-style model {CONFIG}, batch {BATCH} x {SEQ} tokens, fp32, AdamW, gloo on CPU\n")
        print(markdown(res))
    return 0
