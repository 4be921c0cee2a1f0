"""Rank-side checks (and the one-process reference) for transformers' Trainer on a grid: the same
TrainingArguments, seed and data on one process and on every rank of a grid."""

from __future__ import annotations

import inspect
import os

import torch

from tests.checks_hf import build

BATCH, SEQ, N = 4, 8, 32
# dropout draws other masks on a grid than on one process (same distribution): off, to compare runs
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}


class Tokens(torch.utils.data.Dataset):
    """Fixed random token rows, labels = inputs, and a column no model takes (Trainer must drop it)."""

    def __init__(self):
        self.ids = torch.randint(1, 64, (N, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source_file": 3}


def arguments(out: str, max_steps: int = 4, **over):
    import transformers as T

    kw = dict(output_dir=out, per_device_train_batch_size=BATCH, max_steps=max_steps, logging_steps=1,
              learning_rate=1e-2, max_grad_norm=0.5, gradient_accumulation_steps=2, report_to=[],
              disable_tqdm=True, dataloader_num_workers=0, use_cpu=True, save_strategy="no", seed=0)
    return T.TrainingArguments(**{**kw, **over})


def _history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs]}


def reference(family: str, out: str) -> dict:
    """The plain Trainer on one process (no process group): losses, grad norms, final parameters."""
    import transformers as T

    torch.manual_seed(0)
    model, _ = build(family, **NO_DROPOUT[family])
    trainer = T.Trainer(model=model, args=arguments(out), train_dataset=Tokens())
    trainer.train()
    return {**_history(trainer), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _as_launched(rank: int) -> None:
    """The environment torchrun gives, which TrainingArguments and accelerate read. accelerate's
    state is kept between checks: resetting it in a process whose group is up leaves it counting
    one process (then num_items_in_batch is not gathered)."""
    world = torch.distributed.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def _parallel(family, grid):
    import autopar

    torch.manual_seed(0)
    model, _ = build(family, **NO_DROPOUT[family])
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    example = {"input_ids": ids, "labels": ids}
    return autopar.parallelize(model, grid=grid, example_kwargs=example)


def _full(pm) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in pm.named_parameters()}


def train(rank, family, grid, out, save=False) -> dict:
    """ParallelTrainer on this grid: losses, grad norms, final full parameters; with `save`, also
    save_model into out/final, a resume from checkpoint-2 (saved at step 2) and its results."""
    from autopar.hf.trainer import ParallelTrainer

    _as_launched(rank)
    pm = _parallel(family, grid)
    res = {"signature": list(inspect.signature(pm.forward).parameters)[:2]}
    args = arguments(out, save_strategy="steps" if save else "no", save_steps=2)
    trainer = ParallelTrainer(model=pm, args=args, train_dataset=Tokens())
    trainer.train()
    res.update(_history(trainer), params=_full(pm))
    if not save:
        return res
    trainer.save_model(os.path.join(out, "final"))
    again = ParallelTrainer(model=_parallel(family, grid), args=args, train_dataset=Tokens())
    again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    res["resumed"] = {**_history(again), "params": _full(again.model)}
    return res


EVAL_ARGS = dict(bf16=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=BATCH)


def _eval_run(trainer) -> dict:
    """Predict before training (the logits of the whole eval set, from the same weights as one process),
    train (evaluating every 2 steps), then evaluate and predict: the logged train and eval losses, the
    final eval and prediction losses, the shape of the final predictions."""
    before = trainer.predict(Tokens())
    logits = before.predictions[0] if isinstance(before.predictions, tuple) else before.predictions
    trainer.train()
    logs = trainer.state.log_history
    out = {**_history(trainer), "eval_loss": [h["eval_loss"] for h in logs if "eval_loss" in h]}
    out["evaluate"] = trainer.evaluate()["eval_loss"]
    pred = trainer.predict(Tokens())
    out["predict loss"] = pred.metrics["test_loss"]
    out["logits"] = torch.as_tensor(logits).float()
    after = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    out["logits after"] = tuple(after.shape)
    return out


def eval_reference(family: str, out: str) -> dict:
    """The plain Trainer on one process with bf16 autocast and evaluation during training."""
    import transformers as T

    torch.manual_seed(0)
    model, _ = build(family, **NO_DROPOUT[family])
    trainer = T.Trainer(model=model, args=arguments(out, **EVAL_ARGS), train_dataset=Tokens(), eval_dataset=Tokens())
    return _eval_run(trainer)


def train_eval(rank, family, grid, out) -> dict:
    """ParallelTrainer with the same bf16 and evaluation arguments; then the plain Trainer on the
    ParallelModule, which must refuse at construction naming ParallelTrainer."""
    import transformers as T

    from autopar.hf.trainer import ParallelTrainer

    _as_launched(rank)
    pm = _parallel(family, grid)
    args = arguments(out, **EVAL_ARGS)
    res = _eval_run(ParallelTrainer(model=pm, args=args, train_dataset=Tokens(), eval_dataset=Tokens()))
    try:
        T.Trainer(model=pm, args=arguments(out), train_dataset=Tokens())
        res["plain trainer"] = (None, "")
    except Exception as e:  # noqa: BLE001 (what the user sees is the point)
        res["plain trainer"] = (type(e).__name__, str(e))
    return res
