"""What transformers' Trainer and accelerate read off a model, answered for a ParallelModule.

Trainer keeps only the dataset columns the model's `forward` names, passes `num_items_in_batch` when
that signature takes `**kwargs`, and treats a model as tensor parallel when it reports a `tp_size`:
then accelerate does not wrap it in DDP, and the data loader gives every rank of a tensor-parallel
group the same batch (one data-parallel replica per group). A grid is exactly such a group, so a
ParallelModule reports R*C as its `tp_size` and the number of grid replicas as its data-parallel size.
Nothing here imports transformers.
"""

from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass


@dataclass(frozen=True)
class GridParallelism:
    """The grid as transformers' `config.distributed_config` describes a sharded model: `tp_size`
    ranks share one batch, `dp_size` replicas see different batches (replicated, not sharded)."""

    tp_size: int
    dp_size: int

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_size

    @property
    def fsdp_size(self) -> int:
        return 1


# read by Trainer off the model: whether to pass num_items_in_batch, which loss (a causal LM's shifts
# its labels, so Trainer counts labels[..., 1:]), which input counts tokens
MIRRORED = ("accepts_loss_kwargs", "loss_type", "main_input_name")


def refuse_plain_trainer(frame) -> None:
    """Raise when `frame` (the reader of `pmodel.tp_size`) is a method of transformers' own Trainer (or a
    subclass other than autopar's ParallelTrainer): the plain Trainer hands the grid to accelerate as
    tensor parallelism, which accelerate refuses deep in its set-up ("ParallelismConfig is only
    compatible ...") without saying what to use. Read at the Trainer's construction, so it fails there."""
    from autopar.errors import UsageError

    caller = frame.f_locals.get("self") if frame is not None else None
    mro = type(caller).__mro__
    if getattr(type(caller), "autopar_trainer", False) or not any(
            c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in mro):
        return
    raise UsageError(
        f"{type(caller).__name__}(model=pmodel): transformers' Trainer cannot run a ParallelModule (accelerate "
        f"would refuse its grid as tensor parallelism). Use autopar.hf.trainer.ParallelTrainer, which takes the "
        f"same arguments: ParallelTrainer(model=pmodel, args=TrainingArguments(...), train_dataset=...)")


def attach(pmodel, model) -> None:
    """Give `pmodel` the original forward's signature, a `config` carrying its grid, and the
    original's `MIRRORED` attributes that it has."""
    signed = signed_forward(pmodel, model)
    if signed is not None:
        pmodel.forward = signed
    pmodel.config = config_view(model, pmodel.grid)
    for name in MIRRORED:
        if hasattr(model, name):
            setattr(pmodel, name, getattr(model, name))


def signed_forward(pmodel, model):
    """`pmodel.forward` bound with `model.forward`'s signature (None when it has none to read), so
    that `inspect.signature(pmodel.forward)` names the original parameters, `**kwargs` included."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def forward(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)

    forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    forward.__doc__ = type(pmodel).forward.__doc__
    return types.MethodType(forward, pmodel)  # a bound method: copy.deepcopy rebinds it to the copy


class ConfigView:
    """`source`'s attributes, read through, plus `distributed_config`: for a config that takes no new
    attribute, even on a copy (a `slots=True` or frozen dataclass, as torchtitan's model configs are)."""

    def __init__(self, source, distributed_config: GridParallelism):
        self.distributed_config = distributed_config
        self._source = source  # underscored: a config field named `source` must read through

    def __getattr__(self, name):  # called only for names not set above
        return getattr(self.__dict__["_source"], name)

    def __repr__(self) -> str:
        return f"ConfigView({self._source!r}, distributed_config={self.distributed_config!r})"


def config_view(model, grid):
    """`model.config` as transformers' Trainer reads it off a ParallelModule: a shallow copy whose
    `distributed_config` is the grid (a ConfigView where the copy takes no new attribute, or an
    empty namespace for a model without a config). The model's own config object is never written."""
    cp = getattr(grid, "cp", 1)  # context_parallel: the cp copies of a grid share one batch
    parallelism = GridParallelism(tp_size=grid.world * cp, dp_size=grid.dp // cp)
    source = getattr(model, "config", None)
    if source is None:
        return types.SimpleNamespace(distributed_config=parallelism)
    try:
        view = copy.copy(source)
        view.distributed_config = parallelism
    except (AttributeError, TypeError):  # __slots__ without the name, a frozen dataclass, an uncopyable object
        return ConfigView(source, parallelism)
    return view
