"""Rank-side check for reloading what transformers reads and writes: `autopar.from_pretrained` (or
`load_safetensors` into a parallelized model) of a checkpoint prepared by the test process with
transformers' own save_pretrained, a forward compared with transformers' from_pretrained of the same
directory on one process, then `autopar.save_pretrained` for the test to read back with transformers."""

from __future__ import annotations

import warnings

import torch

import autopar
from tests.compare import group_excess


def outputs(out) -> dict:
    """The top-level tensors of a transformers output (loss, logits, aux_loss, last_hidden_state), whole."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in out.items() if isinstance(v, torch.Tensor)}


def reload(rank, src, out_dir, model_class, kwargs, want, grid, into_built=False):
    """from_pretrained(src) on `grid` (or, `into_built`: parallelize a model built from src's config
    with other random weights, then load_safetensors(src) into it) -> outputs against `want` (every
    element, fp32 tolerances of tests/compare.py) -> save_pretrained(out_dir). Returns the excesses
    and the load's warnings."""
    import transformers

    cls = getattr(transformers, model_class) if model_class else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if into_built:
            torch.manual_seed(1)
            config = transformers.AutoConfig.from_pretrained(src)
            model = (cls or getattr(transformers, config.architectures[0]))(config).eval()
            pm = autopar.parallelize(model, grid=grid, example_kwargs=kwargs)
            autopar.load_safetensors(pm, src, progress=False)
        else:
            pm = autopar.from_pretrained(src, grid=grid, example_kwargs=kwargs, progress=False, model_class=cls)
    pm.eval()
    got = outputs(pm(**kwargs))
    errs = {}
    for k, v in want.items():
        errs.update(group_excess({k: (got[k], v)}))
    autopar.save_pretrained(pm, out_dir)
    notes = [str(w.message) for w in caught if issubclass(w.category, autopar.CheckpointWarning)]
    return {"excess": errs, "outputs": sorted(got), "warnings": notes}


def missing_refused(rank, src, kwargs):
    """A LlamaModel file under an untied LlamaForCausalLM: nothing fills lm_head.weight."""
    import transformers

    from tests.checks_robust import _err

    return _err(lambda: autopar.from_pretrained(src, grid=(2, 2), example_kwargs=kwargs, progress=False,
                                                model_class=transformers.LlamaForCausalLM))
