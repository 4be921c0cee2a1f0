"""What the command-line tools share: model building (a transformers type or module:callable), the grid
syntax, --set values and the flags declared from parallelize's options."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_hf(model_type: str, overrides: dict, batch: int, seq: int, meta: bool = True):
    """A transformers model of `model_type` on the meta device (meta=False: with random weights), and one
    step's inputs."""
    import torch
    import transformers

    import autopar

    try:
        config = transformers.AutoConfig.for_model(model_type)
    except ValueError as e:
        raise SystemExit(f"autopar inspect: unknown model type {model_type!r} ({e})") from None
    bad = [k for k in overrides if not hasattr(config, k)]
    if bad:
        keys = sorted(k for k in config.to_dict() if not k.startswith("_"))
        raise SystemExit(f"autopar inspect: {type(config).__name__} has no key(s) {bad}; valid keys: {', '.join(keys)}")
    # built again from the overrides (not set afterwards): derived fields such as head_dim follow them
    with _rejected(model_type, overrides):
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    config.use_cache = False
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                 "AutoModelForImageClassification"):
        cls = getattr(transformers, auto)
        if type(config) in cls._model_mapping:
            break
    else:
        raise SystemExit(f"autopar inspect: no LM or classification head for {type(config).__name__}")
    with autopar.meta_init() if meta else contextlib.nullcontext(), _rejected(model_type, overrides):
        model = cls.from_config(config)
    if auto == "AutoModelForImageClassification":
        size = getattr(config, "image_size", 224)
        kwargs = dict(pixel_values=torch.zeros(batch, getattr(config, "num_channels", 3), size, size),
                      labels=torch.zeros(batch, dtype=torch.long))
    else:
        ids = torch.zeros(batch, seq, dtype=torch.long)
        kwargs = dict(input_ids=ids, labels=ids)
    return model, (), kwargs


@contextlib.contextmanager
def _rejected(model_type: str, overrides: dict):
    """transformers' refusal of a config value (a ValueError from the config's validation or the
    model's constructor, ~10 frames deep) as one line naming the values given and the reason."""
    try:
        yield
    except Exception as e:  # huggingface_hub's validation error is no ValueError; its cause is
        cause = e.__cause__ if e.__cause__ is not None else e
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        given = " ".join(f"--set {k}={json.dumps(v)}" for k, v in overrides.items()) or "the class defaults"
        reason = " ".join(str(cause).split())
        raise SystemExit(f"autopar inspect: {model_type} rejects {given}: {reason}") from None


def build_callable(spec: str):
    mod, _, fn = spec.partition(":")
    out = getattr(importlib.import_module(mod), fn)()
    model, args = out[0], out[1]
    kwargs = out[2] if len(out) > 2 else None
    return model, args if isinstance(args, tuple) else (args,), kwargs


def parse_grid(text: str) -> tuple:
    """'RxC' (e.g. 2x4): the grid syntax of every autopar command. As an argparse `type`, its
    ArgumentTypeError becomes a usage error naming the flag."""
    try:
        r, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RxC, e.g. 2x2 or 1x4") from None
    if min(r, c) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both R and C must be positive, e.g. 2x2 or 1x4")
    return r, c


def option_flag(parser, name: str, note: str, **differs) -> None:
    """`--name` for the parallelize option `name`, from its declaration (`passes.options.OPTIONS`): its
    string choices (None and False stay out, being the flag's absence) and its meaning; `note` and
    `differs` say what the command line does otherwise (a unit, a default that follows another flag)."""
    from passes.options import OPTION

    declared = OPTION[name]
    choices = [c for c in declared.choices if isinstance(c, str)] or None
    flag = dict(choices=choices, default=declared.default, help=f"{declared.help} ({note})")
    parser.add_argument("--" + name.replace("_", "-"), **{**flag, **differs})
