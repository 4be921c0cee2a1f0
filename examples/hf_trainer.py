"""transformers.Trainer on a 2x2 grid: a tiny Llama (random weights, nothing downloaded) trained with
gradient accumulation and clipping, saved as an HF checkpoint, resumed from a Trainer checkpoint.

    torchrun --nproc-per-node 4 examples/hf_trainer.py [output_dir]

Every rank builds the same model, parallelizes it and runs the same ParallelTrainer; every rank of
the grid reads the same batches. Rank 0 prints the logged losses, which match the same Trainer run on
one process (`python examples/hf_trainer.py --one-process`) to ~1e-6.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.hf.trainer import ParallelTrainer  # noqa: E402

BATCH, SEQ = 4, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, vocab=256):
        self.ids = torch.randint(1, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts labels in its loss


def build():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def arguments(out):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=3, seed=0,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, use_cpu=True)


def main(out: str) -> None:
    if "--one-process" in sys.argv:
        trainer = transformers.Trainer(model=build(), args=arguments(out), train_dataset=Tokens())
        trainer.train()
        print("losses:", [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h])
        return
    dist.init_process_group("gloo")  # "nccl" on GPUs, with inputs and model on this rank's device
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    example = {"input_ids": ids, "labels": ids}
    pm = autopar.parallelize(build(), grid=(2, 2), example_kwargs=example)
    trainer = ParallelTrainer(model=pm, args=arguments(out), train_dataset=Tokens())
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))  # every rank takes part; rank 0 writes
    resumed = ParallelTrainer(model=autopar.parallelize(build(), grid=(2, 2), example_kwargs=example),
                              args=arguments(out), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    if dist.get_rank() == 0:
        losses = [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h]
        again = [round(h["loss"], 6) for h in resumed.state.log_history if "loss" in h]
        print("losses:", losses)
        print("resumed from step 3:", again)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
        print("transformers loads", os.path.join(out, "final"), "->", type(loaded).__name__)
    dist.barrier()  # rank 0 was still reading: nobody closes the group under it
    dist.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else os.path.join(tempfile.gettempdir(), "autopar-hf-trainer"))
