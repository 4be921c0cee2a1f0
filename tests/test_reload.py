"""Reload what transformers reads and writes: a checkpoint written by transformers' own
save_pretrained loads with autopar.from_pretrained on every rank and computes what transformers'
from_pretrained of the same directory computes on one process; autopar.save_pretrained then writes the
same keys (names and shapes) that transformers' save_pretrained of that model writes, and transformers
loads them back with no missing or unexpected key and bit-equal tensors.

The cases cover keys that differ from module names (GPT-NeoX's `embed_out`, ViT's and Segformer's old
layout, legacy `gamma`/`beta`), tensors that transformers converts (Mixtral's and Qwen2-MoE's
per-expert weights stacked, Dinov2's fused SwiGLU input split in two), tied weights (GPT-2, Llama with
tied embeddings, T5's four names for one matrix, BERT's decoder) and a base model's checkpoint loaded
under a model with a head, and the reverse.
"""

import json
import os
from dataclasses import dataclass, field

import pytest
import safetensors.torch
import torch
import transformers

from hf_families import FAMILIES, MAKERS, TOKENS
from tests import checks_reload as C
from tests.compare import excess, failures


@dataclass(frozen=True)
class Case:
    family: str  # a key of examples/hf_families.FAMILIES
    why: str
    over: dict = field(default_factory=dict)  # config fields
    saved: str = ""  # the class that writes the checkpoint (default: the family's)
    loaded: str = ""  # the class that reads it (default: config.json's architectures)
    legacy: bool = False  # rewrite LayerNorm weight/bias as the old gamma/beta names
    into_built: bool = False  # load_safetensors into a parallelized model rather than from_pretrained


CASES = {
    "gpt_neox": Case("gpt_neox", "head saved as embed_out (a class-specific renaming)"),
    "gpt2": Case("gpt2", "tied head: the file holds wte only; Conv1D weights"),
    "llama_tied": Case("llama", "tie_word_embeddings=True: no lm_head key", dict(tie_word_embeddings=True)),
    # MoE: load_safetensors into a model built on the CPU, because transformers' experts code picks
    # a CUDA-only path for tensors on the meta device, which from_pretrained traces on (README: Limitations)
    "mixtral": Case("mixtral", "per-expert w1/w2/w3 stacked by a converter, block_sparse_moe renamed to mlp",
                    into_built=True),
    "qwen2_moe": Case("qwen2_moe", "per-expert gate/up/down merged, shared expert beside", into_built=True),
    "dinov2_swiglu": Case("dinov2", "fused SwiGLU weights_in split into gate/up (one key, two tensors)",
                          dict(use_swiglu_ffn=True)),
    "vit": Case("vit", "old layout: attention.attention.query -> attention.q_proj, encoder.layer -> layers"),
    "segformer": Case("segformer", "renamings with captured indices (encoder.block.i -> stages.i.blocks)"),
    "granitemoe": Case("granitemoe", "router.layer / input_linear renamed", into_built=True),
    "bert_legacy": Case("bert", "legacy LayerNorm.gamma/beta names; tied decoder", legacy=True),
    "t5": Case("t5", "one matrix under four names (shared, both embed_tokens, lm_head)"),
    "llama_base_into_lm": Case("llama", "a LlamaModel file (no 'model.' prefix) under LlamaForCausalLM",
                               dict(tie_word_embeddings=True), saved="LlamaModel", loaded="LlamaForCausalLM"),
    "llama_lm_into_base": Case("llama", "a LlamaForCausalLM file under LlamaModel: prefix stripped, lm_head skipped",
                               loaded="LlamaModel"),
}
ONE_BY_FOUR = ["gpt_neox", "mixtral", "dinov2_swiglu"]  # a column count of 4 splits the converted tensors 4 ways


def _build(case: Case):
    fam = FAMILIES[case.family]
    config = getattr(transformers, fam.config)(**{**TOKENS, **fam.kw, **case.over})
    model = getattr(transformers, case.saved or fam.model)(config)
    make = MAKERS[fam.inputs]
    if case.saved == "LlamaModel" or case.loaded == "LlamaModel":
        return model, lambda b, s, seed: {k: v for k, v in make(b, s, seed).items() if k != "labels"}
    return model, make


def _legacy_names(path: str) -> None:
    """Rename LayerNorm weight/bias to gamma/beta in the file, as checkpoints of 2019 name them."""
    f = os.path.join(path, "model.safetensors")
    tensors = safetensors.torch.load_file(f)
    rename = {".LayerNorm.weight": ".LayerNorm.gamma", ".LayerNorm.bias": ".LayerNorm.beta"}
    out = {}
    for k, v in tensors.items():
        for old, new in rename.items():
            k = k.replace(old, new)
        out[k] = v
    assert out.keys() != tensors.keys()
    safetensors.torch.save_file(out, f, metadata={"format": "pt"})


def _keys(path: str) -> dict:
    """{key: shape} over every safetensors file in `path`."""
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(path, name), "pt") as f:
                out.update((k, tuple(f.get_slice(k).get_shape())) for k in f.keys())
    return out


def _roundtrip(pool, tmp_path, name: str, grid):
    """The test process writes the checkpoint and computes the reference with transformers; every
    rank loads and saves with autopar; the test process reads the save back with transformers."""
    case = CASES[name]
    torch.manual_seed(0)
    model, make = _build(case)
    src, out, ref_out = (str(tmp_path / d) for d in ("src", "out", "ref_out"))
    model.save_pretrained(src)
    if case.legacy:
        _legacy_names(src)
    cls = getattr(transformers, case.loaded or type(model).__name__)
    ref, info = cls.from_pretrained(src, output_loading_info=True)
    ref.eval()
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    kwargs = make(4, 8, 1)
    with torch.no_grad():
        want = C.outputs(ref(**kwargs))
    r = pool.run(C.reload, src, out, case.loaded, kwargs, want, grid, case.into_built)
    assert failures([res["excess"] for res in r]) == {}
    assert r[0]["outputs"] == sorted(want)
    skipped = sorted(info["unexpected_keys"])  # transformers' own list; autopar warns with the same keys
    assert len(r[0]["warnings"]) == bool(skipped), (skipped, r[0]["warnings"])
    assert all(f"{len(skipped)} checkpoint key(s) fill nothing and were skipped" in w and all(k in w for k in skipped)
               for w in r[0]["warnings"]), (skipped, r[0]["warnings"])
    assert all(res["warnings"] == [] for res in r[1:])  # rank 0 alone warns
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [cls.__name__]  # autopar.from_pretrained(out) needs no model_class=
    ref.save_pretrained(ref_out)
    assert _keys(out) == _keys(ref_out)  # the key names and shapes transformers writes
    back, info = cls.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want_state, got_state = ref.state_dict(), back.state_dict()
    assert failures([{k: excess(got_state[k], v, rtol=0.0, atol=0.0) for k, v in want_state.items()}]) == {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_checkpoint_roundtrip_2x2(pool4, tmp_path, name):
    """Catches a load that looks checkpoint keys up by module name (GPT-NeoX's embed_out, ViT's old
    layout, per-expert MoE files and gamma/beta all fail so), a converted tensor cut to the wrong
    block, a tied name saved twice or under the name transformers drops, and a save whose keys
    transformers does not read back."""
    _roundtrip(pool4, tmp_path, name, (2, 2))


@pytest.mark.parametrize("name", ONE_BY_FOUR)
def test_transformers_checkpoint_roundtrip_1x4(pool4, tmp_path, name):
    """As at 2x2 on a 1x4 grid: blocks of a quarter of a dim, from renamed and converted tensors."""
    _roundtrip(pool4, tmp_path, name, (1, 4))


def test_missing_parameter_refused_on_every_rank(pool4, tmp_path):
    """Catches a parameter left uninitialized (its block holds whatever memory it got) where the
    checkpoint has no tensor for it: transformers initializes it at random with a warning; autopar
    refuses, naming it, on every rank."""
    model, make = _build(Case("llama", "", saved="LlamaModel", loaded="LlamaModel"))
    model.save_pretrained(str(tmp_path))
    r = pool4.run(C.missing_refused, str(tmp_path), make(4, 8, 1))
    for kind, msg in r:
        assert kind == "MissingWeightsError", (kind, msg)
        assert "holds no tensor for 1 parameter(s) of LlamaForCausalLM: ['lm_head.weight']" in msg, msg
        assert "does not initialize missing parameters at random" in msg, msg


def test_failing_conversion_names_the_keys():
    """Catches transformers' own conversion error surfacing without the checkpoint keys it was
    converting: a Mixtral file whose second expert has another shape than the first."""
    from autopar.checkpoint import keys as hf_keys
    from autopar.checkpoint.hf import meta_init

    fam = FAMILIES["mixtral"]
    with meta_init():
        model = transformers.MixtralForCausalLM(getattr(transformers, fam.config)(**{**TOKENS, **fam.kw}))
    shapes = {"model.layers.0.block_sparse_moe.experts.0.w1.weight": (64, 32),
              "model.layers.0.block_sparse_moe.experts.1.w1.weight": (64, 16),
              "model.layers.0.block_sparse_moe.experts.0.w3.weight": (64, 32),
              "model.layers.0.block_sparse_moe.experts.1.w3.weight": (64, 32)}
    with pytest.raises(ValueError, match=r"transformers converts the checkpoint keys \['model.layers.0.block_sparse_moe"
                                         r".experts.0.w1.weight', .* into 'model.layers.0.mlp.experts.gate_up_proj' "
                                         r"with MergeModulelist, Concatenate, which fails on their shapes"):
        hf_keys.load_plan(model, shapes)


def test_hf_keys_doctest():
    import doctest

    from autopar.checkpoint import keys as hf_keys

    assert doctest.testmod(hf_keys).failed == 0


def test_moved_transformers_internals_named(monkeypatch):
    """Catches an AttributeError deep in a load when transformers moves one of the internals autopar
    calls: the error names the missing piece, the installed version and the tested one."""
    from autopar.checkpoint import keys as hf_keys

    monkeypatch.delattr(transformers.PreTrainedModel, "_adjust_missing_and_unexpected_keys")
    hf_keys.transformers_internals.cache_clear()
    try:
        with pytest.raises(ImportError, match=rf"transformers {transformers.__version__} lacks one of them "
                                              r"\(PreTrainedModel._adjust_missing_and_unexpected_keys is gone\); "
                                              rf"install transformers>=5 \(tested: {hf_keys.TESTED}\)"):
            hf_keys.transformers_internals()
    finally:
        hf_keys.transformers_internals.cache_clear()
