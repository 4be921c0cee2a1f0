"""`ParallelTrainer`: transformers' Trainer for a ParallelModule, launched on every rank.

    pm = autopar.parallelize(model, grid=(2, 2), example_kwargs=batch)
    trainer = ParallelTrainer(model=pm, args=TrainingArguments(...), train_dataset=ds)
    trainer.train()                       # same losses as Trainer(model=model) on one process
    trainer.save_model("out")             # an HF checkpoint: AutoModelForCausalLM.from_pretrained("out")

A grid is a tensor-parallel group to the Trainer (see autopar.parallel.hf_compat): every rank of a grid gets
the same batch, each data-parallel replica of the grid its own, and nothing wraps the model in DDP.
On GPUs accelerate builds that layout itself from `pm.tp_size`; on CPUs accelerate accepts no
tensor parallelism, so this class gives its data loaders the grid's (replica, grid) mesh instead.
What the plain Trainer cannot do for a grid, this class does:

- `save_model` and checkpoints: every rank takes part in `autopar.save_pretrained` (full tensors,
  safetensors + config.json); the optimizer state goes through torch.distributed.checkpoint into
  `<checkpoint>/optimizer_dcp` (any grid can resume it), the scheduler into `scheduler.pt` as usual.
- `resume_from_checkpoint`: each rank reads its blocks of the weights, then the optimizer state.
- TrainingArguments it cannot honour are refused at construction, naming the argument (`SUPPORTED`).
"""

from __future__ import annotations

import os

import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh
from transformers.utils import can_return_loss, find_labels

from autopar.parallel.module import ParallelModule
from autopar.checkpoint.dcp import load_distributed, save_distributed
from autopar.checkpoint.hf import load_safetensors
from autopar.checkpoint.pretrained import save_pretrained
from autopar.errors import CheckpointNotFoundError, UsageError

OPTIMIZER_DIR = "optimizer_dcp"
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")  # torch optimizers, which step DTensor parameters

# argument -> (is it set to something this class cannot honour?, why, what to do)
_REFUSED = {
    "fp16": (bool, "float16 mixed precision (a GradScaler) is not supported", "use bf16=True, or float32"),
    "gradient_checkpointing": (bool, "the compiled graph has no activation checkpointing", "leave it False"),
    "torch_compile": (bool, "the per-rank graph is not run through torch.compile", "leave it False"),
    "fsdp": (bool, "the Trainer's FSDP would wrap the parallel model",
             "shard the replicas in parallelize: grid=(dp, R, C), data_parallel='shard'"),
    "deepspeed": (lambda v: v is not None, "DeepSpeed is not supported", "leave it None"),
    "parallelism_config": (lambda v: v is not None, "the grid is the parallelism",
                           "leave it None; parallelize(model, grid=...) sets it"),
    "label_smoothing_factor": (bool, "the smoothed loss is computed outside the model, on gathered logits",
                               "leave it 0.0"),
    "neftune_noise_alpha": (lambda v: v is not None, "NEFTune hooks the input embeddings, which the "
                            "compiled graph does not call as a module", "leave it None"),
    "use_liger_kernel": (bool, "Liger kernels patch the model's modules, not the compiled graph",
                         "leave it False"),
    "auto_find_batch_size": (bool, "a new batch size would need a new compile on every rank at once",
                             "set per_device_train_batch_size"),
    "push_to_hub": (bool, "pushing is not supported", "push the directory save_model wrote"),
    "load_best_model_at_end": (bool, "it needs evaluation during training", "leave it False"),
    "optim": (lambda v: str(getattr(v, "value", v)) not in OPTIMIZERS, f"supported optimizers are {OPTIMIZERS}",
              "pick one of them"),
}

SUPPORTED = ("per_device_train_batch_size, gradient_accumulation_steps, max_steps, num_train_epochs, "
             "bf16, eval_strategy and evaluate/predict (grid (R, C)), per_device_eval_batch_size, eval_steps, "
             "learning_rate, weight_decay, adam_beta1/2, adam_epsilon, lr_scheduler_type, warmup_steps, "
             "max_grad_norm, seed, data_seed, logging_*, save_strategy 'no'/'steps'/'epoch', save_steps, "
             "save_total_limit, save_only_model, average_tokens_across_devices, dataloader_*, "
             "remove_unused_columns, report_to, disable_tqdm, use_cpu, optim in " + str(OPTIMIZERS))


def check_arguments(args: transformers.TrainingArguments) -> None:
    """Raise UsageError naming the first TrainingArguments field set to something unsupported."""
    for name, (refused, why, fix) in _REFUSED.items():
        value = getattr(args, name, None)
        if value is not None and refused(value):
            raise UsageError(f"TrainingArguments.{name}={value!r}: {why} by autopar's ParallelTrainer; {fix}. "
                             f"Supported: {SUPPORTED}")
    config = getattr(args, "accelerator_config", None)
    for name in ("dispatch_batches", "split_batches"):
        if getattr(config, name, None):
            raise UsageError(f"TrainingArguments.accelerator_config.{name}=True: every rank of a grid loads the "
                             f"same batch itself; leave it unset. Supported: {SUPPORTED}")


def _same_batch(tensor, **_):
    """Trainer's gather_function for a grid without replicas: every rank holds the whole batch already."""
    return tensor


def _full(value):
    """A prediction with its DTensors (split outputs) made whole; tuples and lists alike."""
    if isinstance(value, tuple):
        return tuple(_full(v) for v in value)
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _unwrapped(optimizer):
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    return optimizer


class ParallelTrainer(transformers.Trainer):
    """transformers.Trainer for a ParallelModule; build and call it on every rank, like the model."""

    autopar_trainer = True  # the Trainer a ParallelModule accepts (`hf_compat.refuse_plain_trainer`)

    def __init__(self, model=None, args=None, *rest, **kwargs):
        if not isinstance(model, ParallelModule):
            raise UsageError(f"ParallelTrainer(model=...) got {type(model).__name__}: expected the ParallelModule "
                             f"autopar.parallelize returned (use transformers.Trainer for other models)")
        for name in ("model_init", "compute_loss_func"):
            if kwargs.get(name) is not None:
                raise UsageError(f"ParallelTrainer({name}=...): not supported; the loss is the model's own "
                                 f"(outputs.loss, computed inside the parallel graph)")
        if args is not None:
            check_arguments(args)
        super().__init__(model, args, *rest, **kwargs)
        # Trainer's flag for a model that owns its placement and gradient reduction: prepare it without
        # DDP (set after __init__, which refuses optimizer checkpoints for the models it means; ours resume)
        self.is_distributed_loading_by_transformers = True
        # Trainer reads the label names (which make evaluation compute a loss) off the model's class:
        # ParallelModule's forward takes *args, so read them off the original model's class instead
        source = type(model.source_model)
        if self.args.label_names is None:
            self.label_names = find_labels(source)
        self.can_return_loss = can_return_loss(source)

    def _build_accelerator_args(self, **kwargs) -> dict:
        args = super()._build_accelerator_args(**kwargs)
        if self.model.grid.device_type == "cpu":  # accelerate refuses tensor parallelism on CPUs
            args.pop("parallelism_config", None)
        return args

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.accelerator.parallelism_config is None and torch.distributed.is_initialized():
            grid = self.model.grid  # the data loaders then give every rank of a grid the same batch
            self.accelerator.state.device_mesh = init_device_mesh(
                "cpu", (grid.dp, grid.world), mesh_dim_names=("dp_replicate", "tp"))

    def evaluation_loop(self, *args, **kwargs):
        """Trainer's loop (evaluate, predict, eval_strategy), with predictions gathered over the grid
        replicas only: every rank of a grid evaluated the same batch, so gathering over all ranks (what
        Trainer does) would count each sample R*C times."""
        if self.model.grid.dp > 1:
            raise UsageError("ParallelTrainer: evaluate, predict and eval_strategy run on a grid without data-"
                             "parallel replicas, grid=(R, C); this model has grid=(dp, R, C) with dp="
                             f"{self.model.grid.dp}. Evaluate with a model parallelized on (R, C)")
        self.gather_function = _same_batch
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's step, with split outputs (logits as DTensors) gathered into full tensors: every
        rank of the grid takes part, and each gets the whole prediction."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return _full(loss), _full(logits), _full(labels)

    def _clip_grad_norm(self, model):
        """ParallelModule.clip_grad_norm_: one all-reduce of one number over the grid; returns the
        norm before clipping, as torch's does."""
        return self.model.clip_grad_norm_(self.args.max_grad_norm)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Every rank: the full weights as an HF checkpoint (autopar.save_pretrained), then on the
        writing rank the processing class and the training arguments, as Trainer does."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self.model, output_dir)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_distributed(self.model, os.path.join(output_dir, OPTIMIZER_DIR), optimizer=_unwrapped(self.optimizer))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_safetensors(self.model, resume_from_checkpoint, progress=False)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(state):
            raise CheckpointNotFoundError(f"{checkpoint}: no {OPTIMIZER_DIR}/ (the optimizer state "
                                          f"ParallelTrainer saves); resume from a checkpoint ParallelTrainer wrote "
                                          f"with save_only_model=False")
        load_distributed(self.model, state, optimizer=_unwrapped(self.optimizer))
        scheduler = torch.load(os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)
