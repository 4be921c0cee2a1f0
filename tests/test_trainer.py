"""transformers.Trainer on a grid (autopar.hf.trainer.ParallelTrainer) against the plain Trainer on one
process: same TrainingArguments (gradient accumulation 2, clipping at 0.5), seed and data.

Checks every logged loss and gradient norm (relative 1e-3, the issue's bound; fp32 runs agree to
~1e-6), the final parameters on every rank, save_model loaded back by transformers, and a resume
from a step-2 checkpoint that continues with the same losses and ends at the same parameters.
"""

import os

import pytest
import torch

from tests import checks_trainer as C
from tests.compare import assert_every_rank, group_excess

LOSS_RTOL = 1e-3
# final parameters after 4 Adam steps: Adam divides each gradient element by its running RMS, so
# fp32 rounding in a near-zero gradient element reaches the update undamped; 10x fp32 parity's atol
PARAM_FRAC = 1e-4


def _close_lists(got, want, what):
    assert len(got) == len(want) and got, (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= LOSS_RTOL * abs(w), f"{what} step {i + 1}: {g} vs one process {w}"
    print(f"{what}: max relative difference {max(abs(g - w) / abs(w) for g, w in zip(got, want)):.2g}")


def _same_run(res, ref, what):
    """Losses and grad norms as logged, final parameters element-wise, on every rank."""
    for rank, r in enumerate(res):
        _close_lists(r["loss"], ref["loss"], f"{what} rank {rank} loss")
        _close_lists(r["grad_norm"], ref["grad_norm"], f"{what} rank {rank} grad_norm")
    assert_every_rank([group_excess({n: (p, ref["params"][n]) for n, p in r["params"].items()}, frac=PARAM_FRAC)
                       for r in res], f"{what} final parameters")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = C.reference(family, str(tmp_path_factory.mktemp(f"ref-{family}")))
        return cache[family]
    return get


def test_llama_2x2_train_save_resume(pool4, reference, tmp_path):
    """Catches: input columns dropped (forward signature), num_items_in_batch refused or applied
    to a different token count, every rank reading a different batch (DDP-style sharding of a grid),
    clipping of DTensor gradients, and checkpoints that save one rank's blocks or lose the optimizer."""
    import transformers as T

    ref = reference("llama")
    res = pool4.run(C.train, "llama", (2, 2), str(tmp_path), True)
    for rank, r in enumerate(res):
        assert r["signature"] == ["input_ids", "attention_mask"], (rank, r["signature"])
    _same_run(res, ref, "llama 2x2")
    loaded = T.AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "final"))
    assert_every_rank([group_excess({n: (p, ref["params"][n]) for n, p in loaded.named_parameters()},
                                    frac=PARAM_FRAC)],
                      "save_model loaded by transformers")
    # the resumed log holds steps 1-2 from the checkpoint's trainer_state.json, then steps 3-4 run anew
    _same_run([r["resumed"] for r in res], ref, "resumed at step 2")


@pytest.mark.parametrize("family,grid", [("llama", (1, 4)), ("gpt2", (2, 2))])
def test_other_grid_and_family(pool4, reference, tmp_path, family, grid):
    """1x4 puts every rank in one row (the batch is not split); GPT-2 has Conv1D and a fused c_attn."""
    _same_run(pool4.run(C.train, family, grid, str(tmp_path)), reference(family), f"{family} {grid}")


@pytest.mark.parametrize("over,expected", [
    (dict(gradient_checkpointing=True), "TrainingArguments.gradient_checkpointing=True: the compiled graph"),
    (dict(label_smoothing_factor=0.1), "TrainingArguments.label_smoothing_factor=0.1"),
    (dict(optim="adafactor"), "TrainingArguments.optim="),
    (dict(fp16=True), "TrainingArguments.fp16=True: float16 mixed precision"),
    (dict(torch_compile=True), "TrainingArguments.torch_compile=True"),
])
def test_unsupported_arguments_are_refused(tmp_path, over, expected):
    """Each refusal names the argument, why, and lists what is supported."""
    from autopar.hf.trainer import check_arguments

    with pytest.raises(ValueError, match="Supported: per_device_train_batch_size") as e:
        check_arguments(C.arguments(str(tmp_path), **over))
    assert expected in str(e.value)


def test_plain_model_is_refused(tmp_path):
    from autopar.hf.trainer import ParallelTrainer

    torch.manual_seed(0)
    model, _ = C.build("llama")
    with pytest.raises(ValueError, match="expected the ParallelModule autopar.parallelize returned"):
        ParallelTrainer(model=model, args=C.arguments(str(tmp_path)))


# bf16 autocast: both runs round every matmul to bf16 (8 significant bits), in another order on a grid
# (partial sums of blocks) than on one process, so their losses differ by a few bf16 ulps (2^-8 = 3.9e-3)
BF16_RTOL = 2e-2


def test_bf16_evaluate_predict_and_eval_during_training(pool4, tmp_path):
    """bf16=True, eval_strategy='steps', evaluate() and predict() were refused; the plain Trainer on a
    ParallelModule failed deep in accelerate ('ParallelismConfig is only compatible ...'). Every logged
    loss, eval loss and the predicted logits of the eval set match the plain Trainer on one process
    (bf16 tolerance), on every rank; the plain Trainer now refuses at construction naming ParallelTrainer."""
    ref = C.eval_reference("llama", str(tmp_path / "ref"))
    res = pool4.run(C.train_eval, "llama", (2, 2), str(tmp_path / "grid"))
    assert len(ref["eval_loss"]) == 2, ref  # evaluated at steps 2 and 4
    for rank, r in enumerate(res):
        for key in ("loss", "eval_loss"):
            assert len(r[key]) == len(ref[key]), (rank, key, r[key], ref[key])
            for i, (g, w) in enumerate(zip(r[key], ref[key])):
                assert abs(g - w) <= BF16_RTOL * abs(w), f"rank {rank} {key} {i}: {g} vs one process {w}"
        for key in ("evaluate", "predict loss"):
            assert abs(r[key] - ref[key]) <= BF16_RTOL * abs(ref[key]), (rank, key, r[key], ref[key])
        assert r["logits"].shape == ref["logits"].shape == (C.N, C.SEQ, 64), (rank, r["logits"].shape)
        assert r["logits after"] == ref["logits after"], (rank, r["logits after"], ref["logits after"])
        # the logits predicted before training (the same weights on both sides): the whole eval set, once
        scale = ref["logits"].abs().max().item()
        err = (r["logits"] - ref["logits"]).abs().max().item()
        assert err <= BF16_RTOL * scale, f"rank {rank}: logits differ by {err}, scale {scale}"
        kind, msg = r["plain trainer"]
        assert kind == "UsageError" and "Use autopar.hf.trainer.ParallelTrainer" in msg, (rank, r["plain trainer"])
