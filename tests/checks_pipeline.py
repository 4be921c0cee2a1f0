"""Rank-side checks of pipeline stages (parallelize(..., pipeline=...)). Each returns plain data for the
test to assert on."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

import autopar
from autopar.program.pipe import cut, named, split_points
from tests.checks_hf import build
from tests.compare import group_excess

STEPS = 3


def _llama(layers: int = 2):
    return _model("llama", layers)


def _model(family: str, layers: int):
    """(model, batch maker) of a family: HF Llama or GPT-2 (its LM head tied to the token embedding), or
    the repo's TinyGPT (tied too; its forward takes `ids` and returns logits)."""
    torch.manual_seed(0)
    if family == "tinygpt":
        from examples.models import GPTConfig, TinyGPT

        def make(b, s, seed):
            g = torch.Generator().manual_seed(seed)
            return dict(input_ids=torch.randint(0, 64, (b, s), generator=g),
                        labels=torch.randint(0, 64, (b, s), generator=g))
        return TinyGPT(GPTConfig(layers=layers)), make
    if family == "mixtral":  # experts routed per token, in each stage; without the load-balancing loss, which
        import hf_families  # is a function of the whole batch's routing, not a sum over micro-batches

        return hf_families.build("mixtral", num_hidden_layers=layers, use_cache=False, output_router_logits=False)
    if family == "llama-uneven":  # a vocabulary of 97 rows and 3 heads: blocks of unequal sizes on the grid
        return build("llama", use_cache=False, num_hidden_layers=layers, vocab_size=97, hidden_size=48,
                     num_attention_heads=3, num_key_value_heads=3)
    # GPT-2's dropout off: one process and the ranks would draw different masks
    over = dict(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" \
        else {"num_hidden_layers": layers}
    return build(family, use_cache=False, **over)


def _padded(make, rows: int, seed: int) -> dict:
    """A batch whose rows count different numbers of tokens: row i ignores its last min(i, 6) labels."""
    kw = make(rows, 8, seed)
    labels = kw["labels"].clone()
    for i in range(1, rows):
        labels[i, 8 - min(i, 6):] = -100
    return dict(input_ids=kw["input_ids"], labels=labels)


def parity(rank, grid, schedule, stages=2, labels=True, microbatches=None, per_rank=1,
           data_parallel="replicate", family="llama", **options) -> dict:
    """`STEPS` AdamW steps of a 2-layer HF Llama cut into `stages` stages, each on `grid`, against one
    process on the whole batch (8 rows of unequal counted tokens): the loss every step on every rank,
    every gradient of this rank's stage after the first step, and its parameters after the last.
    `labels`: the model's own loss; else its logits with a cross-entropy given as loss_fn. `per_rank`:
    stages per pipeline rank (the model gets one layer per stage); `family`: see `_model`. Then an eval
    forward against one process's."""
    model, make = _model(family, 2 * per_rank)
    ref = copy.deepcopy(model)
    batch = _padded(make, 8, 1)
    pipe = autopar.Pipeline(stages=stages, schedule=schedule, microbatches=microbatches, stages_per_rank=per_rank)
    example = named(model, (), batch) if labels else named(model, (batch["input_ids"],), {})
    whole = sum(t.numel() * t.element_size() for t in _whole_boundary(model, example, pipe))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=grid, example_kwargs=example, pipeline=pipe, data_parallel=data_parallel,
                                 **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)  # eps: rounding noise in a near-zero gradient
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)  # is not blown up to a full step
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # a tied weight under each of its names

    def ce(logits, target):  # the loss transformers computes, on a micro-batch
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))

    out: dict = {"stage": pm.grid.stage, "names": sorted(n for n, _ in pm.named_parameters()),
                 "whole sent": whole}
    for step in range(STEPS):
        batch = _padded(make, 8, step + 1)
        pm.grid.log.reset()
        if labels:
            loss = pm.train_step(**batch)
        else:
            loss = pm.train_step(batch["input_ids"], target=batch["labels"], loss_fn=ce)  # positional: named as
            # the model's forward names it
        if labels:  # transformers' loss on the whole batch: the mean over its counted tokens
            want = ref(**batch).loss
        else:  # loss_fn's convention (torch.distributed.pipelining's): the mean of the micro-batches' losses
            logits, m = _logits(ref(batch["input_ids"])), pipe.n_microbatches
            want = sum(ce(lg, lb) for lg, lb in zip(logits.chunk(m), batch["labels"].chunk(m))) / m
        want.backward()
        out.update(group_excess({f"loss step {step}": (loss, want.detach())}))
        out[f"losses {step}"] = (float(loss), float(want))
        if step == 0:
            log = pm.grid.log
            out["p2p counted"] = {ph: (log.launches[("pp:send", ph)], log.bytes[("pp:send", ph)])
                                  for ph in ("fwd", "bwd")}
            out["p2p planned"] = pm.p2p_traffic()
            out["dp calls"] = log.calls("dp:")  # replicated replicas: gradients averaged once per step
            out["grid bytes"] = log.total() - log.total("pp:") - log.total("dp:")
            out["at"] = (pm.grid.r, pm.grid.c)
            out.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                    prefix="grad "))
            norm = pm.clip_grad_norm_(1e9)
            out.update(group_excess({"grad norm": (norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))}))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out.update(group_excess({n: (p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()},
                            prefix=f"param after {STEPS} steps "))
    out["explain"] = autopar.explain(pm).splitlines()[0]
    pm.eval()  # an eval forward through the stages: the last stage's outputs on every rank
    ref.eval()
    with torch.no_grad():
        want = ref(**batch) if labels else ref(batch["input_ids"])
        got = pm(**batch) if labels else pm(batch["input_ids"])
    got = got if isinstance(got, tuple) else (got,)
    want_logits = _logits(want)  # the stages return the output's tensors as a tuple: the logits by their shape
    got_logits = next(t for t in got if tuple(t.shape) == tuple(want_logits.shape))
    out.update(group_excess({"eval logits": (got_logits, want_logits)}))
    if labels:
        out.update(group_excess({"eval loss": (got[0], want.loss)}))
    # a weight tied across stages is held once per stage that reads it (each its copy): counted per name
    total = sum(p.numel() for _, p in ref.named_parameters(remove_duplicate=False))
    out["held"] = sum(p.to_local().numel() for p in pm.parameters()) / total
    return out


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _whole_boundary(model, batch, pipe) -> list:
    """What stage 0 would send per step if its outputs crossed whole (one micro-batch's, times M)."""
    m = pipe.n_microbatches
    mb = {k: v[: v.shape[0] // m] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    _, seen, _ = cut(model, split_points(model, None, pipe.total), (), mb, pipe.total)
    return list(seen[0][1]) * m


def refusals(rank) -> dict:
    """What a user sees for a bad pipeline request, on every rank."""
    model, make = _llama()
    batch = make(8, 8, 1)
    out = {}
    cases = {
        "microbatches": dict(pipeline=autopar.Pipeline(stages=2, microbatches=3)),
        "split point": dict(pipeline=autopar.Pipeline(stages=2, split_points=["model.layer.1"])),
        "world": dict(pipeline=4),
    }
    for name, kw in cases.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                autopar.parallelize(model, **{"grid": (1, 2), **kw}, example_kwargs=batch)
            out[name] = "no error"
        except (autopar.UsageError, autopar.UnsupportedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    for name, kw in (("schedule", dict(schedule="chimera")), ("per rank", dict(stages_per_rank=2)),
                     ("v per rank", dict(schedule="zbv_zero_bubble"))):
        try:
            autopar.Pipeline(stages=2, **kw)
            out[name] = "no error"
        except autopar.UsageError as e:
            out[name] = str(e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=(1, 2), example_kwargs=batch, pipeline=2)
    for name, call in (("forward", lambda: pm(**batch)), ("generate", lambda: pm.generate(batch["input_ids"])),
                       ("no labels", lambda: pm.train_step(input_ids=batch["input_ids"]))):
        try:
            call()
            out[name] = "no error"
        except (autopar.UsageError, autopar.UnsupportedError) as e:
            out[name] = str(e)
    return out


def planned(grid, schedule, labels=True, per_rank=1, microbatches=None, family="llama"):
    """autopar.plan(..., pipeline=...) of `parity`'s model and batch, on this process: per pipeline rank,
    the point-to-point bytes per step and the grid's bytes per step (position (0, 0))."""
    model, make = _model(family, 2 * per_rank)
    batch = _padded(make, 8, 1)
    example = named(model, (), batch) if labels else named(model, (batch["input_ids"],), {})
    pipe = autopar.Pipeline(stages=2, schedule=schedule, microbatches=microbatches, stages_per_rank=per_rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = autopar.plan(model, grid=grid, example_kwargs=example, pipeline=pipe)
    m = pipe.n_microbatches
    return {r["rank"]: (r["sends_per_step_bytes"], m * sum(pl.stages[j].comm_bytes for j in r["stages"]))
            for r in pl.ranks}


def _full(pm) -> dict:
    """Every parameter of the model, whole, by name, from whichever rank holds it (all ranks)."""
    import torch.distributed as dist

    mine = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in pm.named_parameters()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict = {}
    for d in everyone:
        out.update(d)
    return out


def checkpoints(rank, tmp: str) -> dict:
    """GPT-2 (LM head tied to the embedding, a copy on each end of the pipeline) trained one step as
    2 stages x 1x2, saved with torch.distributed.checkpoint (model and AdamW) and with save_pretrained,
    then read back: into 2x2 without stages, into 2 stages x 2x1, and (the other way) a 2x2
    checkpoint into 2 stages x 1x2 (its second copy read under the first name). Each compared with the
    saved values; then one more step of the saved model and of the one loaded at 2 stages x 2x1 (its
    optimizer state loaded too) must agree; transformers reads the save_pretrained directory."""
    import transformers

    def fresh(seed):
        torch.manual_seed(seed)
        model, make = _model("gpt2", 2)
        return model, make

    def wrap(model, make, grid, pipeline):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.parallelize(model, grid=grid, example_kwargs=make(4, 8, 1), pipeline=pipeline)

    model, make = fresh(0)
    pm = wrap(model, make, (1, 2), 2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    batch = make(4, 8, 5)
    pm.train_step(**batch)
    opt.step()
    opt.zero_grad()
    want = _full(pm)
    autopar.save_distributed(pm, f"{tmp}/dcp", optimizer=opt)
    autopar.save_pretrained(pm, f"{tmp}/hf")
    out: dict = {}
    flat = wrap(*fresh(1), (2, 2), None)  # no stages: one copy of the tied weight
    autopar.load_distributed(flat, f"{tmp}/dcp")
    got = _full(flat)
    out.update(group_excess({n: (got[n], want[n]) for n in got}, prefix="dcp into 2x2 "))
    other = wrap(*fresh(2), (2, 1), 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    autopar.load_distributed(other, f"{tmp}/dcp", optimizer=other_opt)
    got = _full(other)
    out.update(group_excess({n: (got[n], want[n]) for n in got}, prefix="dcp into 2 x 2x1 "))
    for p, o in ((pm, opt), (other, other_opt)):
        p.train_step(**make(4, 8, 6))
        o.step()
    after, other_after = _full(pm), _full(other)
    out.update(group_excess({n: (other_after[n], after[n]) for n in after}, prefix="a step after loading "))
    autopar.save_distributed(flat, f"{tmp}/dcp-flat")
    back = wrap(*fresh(3), (1, 2), 2)
    autopar.load_distributed(back, f"{tmp}/dcp-flat")
    got = _full(back)
    tied = {"lm_head.weight": "transformer.wte.weight"}
    out.update(group_excess({n: (got[n], want[tied.get(n, n)]) for n in got}, prefix="2x2 dcp into 2 x 1x2 "))
    out["names"] = sorted(got)
    if rank == 0:
        hf = transformers.GPT2LMHeadModel.from_pretrained(f"{tmp}/hf")
        loaded = dict(hf.named_parameters(remove_duplicate=False))
        out["hf"] = group_excess({n: (loaded[n], want[tied.get(n, n)]) for n in loaded})
    return out


class _LogitsThenLoss(torch.nn.Module):
    """A user's own model whose forward returns (logits, loss), the loss second, with its own targets
    argument (not `labels`): a mean cross-entropy over the tokens not -100, unshifted."""

    def __init__(self, vocab: int = 32, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(hidden),
                                                              torch.nn.Linear(hidden, hidden), torch.nn.GELU())
                                          for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids, targets):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _head(kind: str):
    """(model, batch(seed)) for a model whose loss counts something other than a causal LM's shifted
    labels, each batch with rows that count different numbers of targets (or none: -100)."""
    import transformers as T

    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)

    def ids(seed, b=8, s=8):
        return torch.randint(1, 64, (b, s), generator=torch.Generator().manual_seed(seed))

    def ragged(labels):  # row i ignores its last min(i, 6) targets (row 0 none; a [B] label: every third row)
        labels = labels.clone()
        if labels.dim() == 1:
            labels[::3] = -100
        else:
            for i in range(1, labels.shape[0]):
                labels[i, labels.shape[1] - min(i, 6):] = -100
        return labels

    if kind == "sequence":  # labels [B]: one class per row
        model = T.LlamaForSequenceClassification(T.LlamaConfig(num_labels=3, **cfg))
        return model, lambda seed: dict(input_ids=ids(seed), labels=ragged(ids(seed + 50)[:, 0] % 3))
    if kind == "regression":  # labels [B] floats: a mean squared error over the rows
        model = T.LlamaForSequenceClassification(T.LlamaConfig(num_labels=1, **cfg))
        return model, lambda seed: dict(input_ids=ids(seed), labels=torch.randn(
            8, generator=torch.Generator().manual_seed(seed)))
    if kind == "token":  # labels [B, S], not shifted (its head's dropout off: one process draws other masks)
        model = T.LlamaForTokenClassification(T.LlamaConfig(num_labels=5, classifier_dropout=0.0, **cfg))
        return model, lambda seed: dict(input_ids=ids(seed), labels=ragged(ids(seed + 50) % 5))
    model = _LogitsThenLoss()
    return model, lambda seed: dict(ids=ids(seed) % 32, targets=ragged(ids(seed + 50) % 32))


def head_parity(rank, kind: str, grid=(1, 2), microbatches: int = 4) -> dict:
    """Two AdamW steps of a model whose loss is not a causal LM's (`_head(kind)`), cut into 2 stages on
    `grid` with `microbatches`, against one process on the whole batch: the loss of each step, every
    gradient of this rank's stage, an eval forward's loss."""
    model, make = _head(kind)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.parallelize(model, grid=grid, example_kwargs=make(1),
                                 pipeline=autopar.Pipeline(stages=2, microbatches=microbatches))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (pm, ref))
    ref_params = dict(ref.named_parameters())
    out: dict = {}
    for step in range(2):
        batch = make(step + 1)
        loss = pm.train_step(**batch)
        got = ref(**batch)
        want = got[1] if isinstance(got, tuple) else got.loss
        want.backward()
        out.update(group_excess({f"loss step {step}": (loss, want.detach())}))
        out.update(group_excess({n: (p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
                                prefix=f"grad step {step} "))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    pm.eval()
    ref.eval()
    batch = make(9)
    with torch.no_grad():
        got, want = pm(**batch), ref(**batch)
    at = 1 if kind == "own" else 0
    out.update(group_excess({"eval loss": (got[at], want[1] if kind == "own" else want.loss)}))
    return out


_FINAL_NORM = {"llama": "model.norm.weight", "gpt2": "transformer.ln_f.weight"}  # a key of the last stage only


def load_full(rank, family: str = "llama", stages_per_rank: int = 1) -> dict:
    """A one-process model's state_dict (plain full tensors, every stage's keys, a transformers Llama's
    rotary table left out as torch leaves out non-persistent buffers) loaded into a pipelined model of
    another initialisation, 2 stages x 1x2: each rank's parameters against the state_dict's values, a
    training step's loss against the one-process model's; then the errors for a key of no stage and a
    key missing from this rank's stage."""
    model, make = _model(family, 2 * stages_per_rank)
    torch.manual_seed(5)
    source, _ = _model(family, 2 * stages_per_rank)  # another seed inside _model is fixed: re-initialise
    for p in source.parameters():
        torch.nn.init.normal_(p, std=0.02)
    full = source.state_dict()
    if family == "gpt2":  # as a safetensors file holds a tied weight: once, under its first name
        full.pop("lm_head.weight")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopar.Pipeline(stages=2, schedule="1f1b" if stages_per_rank == 1 else "interleaved_1f1b",
                                stages_per_rank=stages_per_rank)
        pm = autopar.parallelize(model, grid=(1, 2), example_kwargs=make(4, 8, 1), pipeline=pipe)
    result = pm.load_state_dict(full)
    out: dict = {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}
    tied = {"lm_head.weight": "transformer.wte.weight"} if family == "gpt2" else {}
    out.update(group_excess({n: (p.full_tensor(), full[tied.get(n, n)]) for n, p in pm.named_parameters()},
                            prefix="loaded "))
    batch = make(4, 8, 2)
    loss = pm.train_step(**batch)
    out.update(group_excess({"loss after load": (loss, source(**batch).loss.detach())}))
    for name, bad in (("unknown key", {**full, "model.not_a_layer.weight": torch.zeros(2)}),
                      ("missing key", {k: v for k, v in full.items() if k != _FINAL_NORM[family]})):
        try:
            pm.load_state_dict(bad)
            out[name] = "no error"
        except autopar.UsageError as e:
            out[name] = str(e)
    out["stage"] = pm.grid.stage
    return out
