"""Rank-side checks that a plan made on one process is what a real run does."""

from __future__ import annotations

import torch
import torch.nn as nn

import autopar
from tests.checks_hf import build
from tests.checks_robust import SweepBlock


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    return model, (torch.randn(4, 8, 16),), None


def _attention():
    torch.manual_seed(0)
    spec = dict(hidden=16, heads=4, ffn=32, norm="layer", fused=True, attn="sdpa", act="gelu", bias=True)
    return SweepBlock(spec), (torch.randn(4, 8, 16),), None


def _gpt2():
    torch.manual_seed(0)
    model, make = build("gpt2")
    return model, (), make(4, 8, 0)


def _bench_llama():
    from autopar.bench import common

    return common.model(), (), common.batch(0)


def _mixtral():
    import hf_families

    torch.manual_seed(0)
    model, make = hf_families.build("mixtral")
    return model, (), make(4, 8, 1)


def _peft_llama():
    """peft LoRA on q_proj and v_proj: every base weight frozen (requires_grad=False)."""
    import peft

    torch.manual_seed(0)
    model, make = build("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora), (), make(4, 8, 0)


MODELS = {"peft llama": _peft_llama, "mlp": _mlp, "attention": _attention, "gpt2": _gpt2, "bench llama": _bench_llama,
          "mixtral": _mixtral}


ROUTING_KERNELS = ("ExpertDispatch", "ExpertCombine", "ExpertOffsets")


def plan_vs_run(rank, name, grid=(2, 2), strategy="2d"):
    """The plan's code equals parallelize's, and its bytes equal what one real step counts."""
    model, args, kwargs = MODELS[name]()
    pl = autopar.plan(model, grid=grid, example_inputs=args, example_kwargs=kwargs, strategy=strategy)
    pm = autopar.parallelize(model, grid=grid, example_inputs=args, example_kwargs=kwargs, strategy=strategy)
    pm.grid.log.reset()
    out = pm(*args, **(kwargs or {}))
    loss = out.loss if hasattr(out, "loss") else out
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss.sum().backward()
    # the token dispatch's sizes depend on the routing: planned for balanced routing, counted as routed
    routing = sum(r.fwd_bytes + r.bwd_bytes for r in pl.rows if r.op.startswith(ROUTING_KERNELS))
    return {"same code": pl.gm.code == pm.graph_module.code, "planned": pl.comm_bytes_per_rank_per_step - routing,
            "counted": pm.grid.log.total() - pm.grid.log.total("moe:"), "routing": routing,
            "planned calls": (pl.collectives_fwd, pl.collectives_bwd),
            "counted calls": (pm.grid.log.calls(phase="fwd"), pm.grid.log.calls(phase="bwd")),
            "rows": [(r.op, r.collectives, r.fwd_bytes, r.bwd_bytes) for r in pl.rows if r.collectives]}


def meta_llama(layers: int, vocab: int = 128, intermediate: int = 128, seq: int = 16):
    """A small HF Llama built on the meta device (hidden 64, 4 heads) and one call's keyword inputs
    (batch 4 x `seq`), for plans on one process."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=max(32, seq), pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                   use_cache=False)
    with autopar.meta_init():
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(4, seq, dtype=torch.long)
    return model, dict(input_ids=ids, labels=ids)
